//! The run configuration: one serde struct whose defaults are the embedded default run,
//! settable from a TOML file (`--config`) and overridden by command-line flags.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fx_data::{Regime, SplitConfig, SyntheticConfig};
use fx_hw::Precision;
use fx_kernels::EnvConfig;
use fx_models::seq::SeqTrainConfig;
use fx_models::{DqnConfig, LinearSchedule, Mamba2Config, PpoConfig, TftConfig};
use serde::{Deserialize, Serialize};

/// Which agent a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum ModelChoice {
    #[default]
    Dqn,
    Ppo,
    Tft,
    Mamba2,
}

impl ModelChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelChoice::Dqn => "dqn",
            ModelChoice::Ppo => "ppo",
            ModelChoice::Tft => "tft",
            ModelChoice::Mamba2 => "mamba2",
        }
    }

    /// A supervised sequence model (TFT, MAMBA-2) rather than an RL agent.
    pub fn is_sequence(self) -> bool {
        matches!(self, ModelChoice::Tft | ModelChoice::Mamba2)
    }
}

/// Which model batch keys a config file set itself (an explicit key wins over `batch = "auto"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchKeysGiven {
    pub dqn: bool,
    pub ppo: bool,
    pub seq: bool,
}

/// Everything a training run is configured by. `config.toml` in the run folder holds
/// the resolved value, every default written out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// The model: dqn or ppo (RL agents), tft or mamba2 (return forecasters).
    pub model: ModelChoice,
    /// Feature file (`.safetensors`) or OHLCV bars (`.csv`); none: the synthetic market.
    pub data: Option<PathBuf>,
    /// Run folder (config, metrics, checkpoints, report, plots).
    pub out: PathBuf,
    /// Environment steps to train for (each steps all `env.num_envs` accounts).
    pub steps: u64,
    /// Seed of everything random in the run (weights, env draws, synthetic market).
    pub seed: u64,
    /// Seed of the synthetic market alone; none: `seed`. A sweep sets it so that its trials,
    /// whatever their `seed`, train and are scored on one market.
    pub data_seed: Option<u64>,
    /// Compute precision (weights and optimiser state stay F32).
    pub precision: Precision,
    /// Device: auto, cpu, cuda or cuda:N.
    pub device: String,
    /// CPU threads for candle's CPU kernels; none: one for dqn/ppo (small networks), every
    /// usable CPU (affinity, cgroup quota) for tft/mamba2; `FX_THREADS` overrides none.
    pub threads: Option<usize>,
    /// Batch of the model trained (it sets `dqn.batch_size`, `ppo.minibatch_size` or
    /// `seq.batch_size`): "auto" takes the hardware budget's batch for the run's device,
    /// bounded by the data (on the CPU the model key's value stands; the rules are in
    /// fx-train's `batch` module and the README), or a number. The model's own key set in a
    /// config file wins over "auto". config.toml records the number the run used.
    pub batch: crate::batch::BatchSize,
    /// Where a numeric `batch` came from (config, FX_BATCH_SIZE or --batch-size).
    #[serde(skip)]
    pub batch_source: crate::batch::BatchSource,
    /// The config file set the model's own batch key (per model, see [`Self::model_key_given`]).
    #[serde(skip)]
    pub batch_keys_given: BatchKeysGiven,
    /// CUDA graph capture of the training step (every model): auto (capture, warn and run
    /// eagerly if it fails), on (a failed capture is an error) or off. Ignored on the CPU.
    pub graph: fx_precision::GraphMode,
    /// Environment steps between checkpoints.
    pub checkpoint_every: u64,
    /// Checkpoints kept in the run folder (the newest).
    pub keep_checkpoints: usize,
    /// Environment steps between lines of metrics.jsonl.
    pub log_every: u64,
    /// Bars per year for annualised statistics; none: inferred from the timestamps.
    pub periods_per_year: Option<f64>,
    /// Seeds per fold of a study (`--seeds`): runs with `seed`, `seed + 1`, ... on one
    /// market; more than 1 (or `walk_forward`) makes `train` a study (fx-train's `study`).
    pub seeds: usize,
    /// Trials tried before a study (e.g. a sweep's count), counted with its seeds in the
    /// deflated Sharpe ratio.
    pub prior_trials: usize,
    /// The synthetic market used when `data` is none.
    pub synthetic: SyntheticConfig,
    /// Chronological train/validation/test split.
    pub split: SplitConfig,
    /// Walk-forward folds (`--folds`, `--window`): a study of train → validation → test
    /// spans in time order; none: one run on `split`.
    pub walk_forward: Option<fx_data::WalkForwardConfig>,
    /// Walk-forward (`--warm-start`): each fold after the first starts from the previous
    /// fold's final weights of the same seed (optimiser, replay and ε schedule fresh).
    pub warm_start: bool,
    /// A DQN or PPO study (`--population`): its runs, a member per fold and seed, train
    /// together as one population instead of one after another. Written to `config.toml`
    /// only when set.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub population: bool,
    /// Row spans of one fold's run (a study sets them for each of its runs); none: `split`.
    pub rows: Option<fx_data::Splits>,
    /// A trainer state file whose network weights a fresh run starts from (a study sets it
    /// for a warm-started fold: the previous fold's last checkpoint); ignored on resume.
    pub init_from: Option<PathBuf>,
    /// A sweep's forecaster trial: its report scores the validation split, and the test
    /// split is left for the trials the sweep chooses (their runs are ordinary). Written to
    /// `config.toml` only when set.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub validation_only: bool,
    /// The training environment (episode length, cost, number of accounts).
    pub env: EnvConfig,
    /// DQN hyper-parameters (`model = "dqn"`).
    pub dqn: DqnConfig,
    /// PPO hyper-parameters (`model = "ppo"`).
    pub ppo: PpoConfig,
    /// TFT dimensions (`model = "tft"`); `n_observed`/`n_known` are set from the data.
    pub tft: TftConfig,
    /// MAMBA-2 dimensions (`model = "mamba2"`); `n_in` is set from the data.
    pub mamba2: Mamba2Config,
    /// Steps per MAMBA-2 training window.
    pub mamba2_seq_len: usize,
    /// Training of the sequence models (tft, mamba2): epochs, batch, AdamW with warm-up
    /// and cosine decay, clipping, early stopping. `seed` and `precision` come from the
    /// run's. `steps`, `checkpoint_every` and `log_every` count environment steps and do
    /// not apply: these runs log and checkpoint once per epoch.
    pub seq: SeqTrainConfig,
}

impl Default for RunConfig {
    /// The embedded default: a DQN on 6,000 hourly synthetic bars whose returns carry a
    /// strong AR(1) signal (φ 0.4–0.5 by regime), sized to show learning on two CPU cores in
    /// well under a minute. The network shapes, AdamW, clipping and target updates are the
    /// spec's; the schedule is shortened for a run this short (ε over the first half,
    /// learning from 2,048 transitions, lr 1e-3, γ 0.5: the signal pays one bar ahead).
    ///
    /// The sequence models default to CPU-sized versions of the spec's (which are
    /// `TftConfig::default()` / `Mamba2Config::default()`: d 128, L_enc 64, H 8; d_model
    /// 256 × 4 layers, d_state 64): TFT d 16, 2 heads, L_enc 16, H 2, no dropout (so a
    /// resumed run is bit-identical on the CPU); MAMBA-2 d_model 16 × 2 layers, d_state 16,
    /// head 16, chunk 16 on 32-step windows; 4 epochs of batch 64 at lr 1e-3, patience 2.
    /// On the synthetic default each beats the zero and last-value forecasts on the test
    /// split, the TFT in about 50 s and the MAMBA-2 in about 10 s on two CPU cores.
    fn default() -> Self {
        let steps = 2000;
        let dqn = DqnConfig {
            batch_size: 256,
            replay_capacity: 64_000,
            learning_starts: 2048,
            epsilon: LinearSchedule { start: 1.0, end: 0.05, steps: steps / 2 },
            gamma: 0.5,
            optimizer: fx_precision::AdamWConfig { lr: 1e-3, ..DqnConfig::default().optimizer },
            ..DqnConfig::default()
        };
        let regimes = vec![
            Regime { drift: 2e-4, vol_scale: 0.8, ar: 0.5, mean_duration: 600.0 },
            Regime { drift: -2e-4, vol_scale: 1.3, ar: 0.5, mean_duration: 300.0 },
            Regime { drift: 0.0, vol_scale: 1.0, ar: 0.4, mean_duration: 400.0 },
        ];
        let ppo = PpoConfig { num_steps: 64, minibatch_size: 512, ..PpoConfig::default() };
        RunConfig {
            model: ModelChoice::Dqn,
            data: None,
            out: PathBuf::from("runs/default"),
            steps,
            seed: 7,
            data_seed: None,
            precision: Precision::F32,
            device: "auto".into(),
            batch: crate::batch::BatchSize::Auto,
            batch_source: crate::batch::BatchSource::Config,
            batch_keys_given: BatchKeysGiven::default(),
            graph: fx_precision::GraphMode::Auto,
            threads: None,
            checkpoint_every: 500,
            keep_checkpoints: 3,
            log_every: 50,
            periods_per_year: None,
            synthetic: SyntheticConfig { bars: 6_000, regimes, ..SyntheticConfig::default() },
            split: SplitConfig::default(),
            seeds: 1,
            prior_trials: 0,
            walk_forward: None,
            warm_start: false,
            population: false,
            rows: None,
            init_from: None,
            validation_only: false,
            env: EnvConfig { num_envs: 32, ..EnvConfig::default() },
            dqn,
            ppo,
            tft: TftConfig { d: 16, n_head: 2, l_enc: 16, h: 2, dropout: 0.0, ..TftConfig::default() },
            mamba2: Mamba2Config {
                d_model: 16,
                n_layer: 2,
                d_state: 16,
                headdim: 16,
                chunk_size: 16,
                ..Mamba2Config::default()
            },
            mamba2_seq_len: 32,
            seq: SeqTrainConfig { epochs: 4, batch_size: 64, lr: 1e-3, patience: 2, ..SeqTrainConfig::default() },
        }
    }
}

impl RunConfig {
    /// Reads a TOML config; unknown keys are errors that name the file. A parse error is
    /// one line: `parsing config FILE: line L, column C: what`.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = fx_data::files::read_regular_to_string(path, fx_data::files::MAX_TEXT_BYTES)
            .with_context(|| format!("reading config {}", path.display()))?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// [`Self::from_toml_file`] on a text; `source` names it in errors.
    ///
    /// A key the file leaves out takes the plain run's value (`RunConfig::default()`, what
    /// a plain run's `config.toml` writes), also inside a section the file opens for one key
    /// of it: `[dqn] gamma = 0.5` changes γ and nothing else. (Deserialised section by
    /// section, a one-key `[dqn]` would take `DqnConfig::default()`'s full-size schedule
    /// for every other key.)
    pub fn from_toml_str(text: &str, source: &str) -> Result<Self> {
        let text = text.to_string();
        // Parsed once as it is, for errors that point at the file's line and column.
        toml::from_str::<Self>(&text)
            .map_err(|e| toml_error(&text, &e))
            .with_context(|| format!("parsing config {source}"))?;
        let given: toml::Table = text.parse().map_err(|e| toml_error(&text, &e))?;
        // Which model batch keys the file sets itself, read before the defaults fill them in.
        let has = |section: &str, key: &str| given.get(section).and_then(|s| s.get(key)).is_some();
        let batch_keys_given = BatchKeysGiven {
            dqn: has("dqn", "batch_size"),
            ppo: has("ppo", "minibatch_size"),
            seq: has("seq", "batch_size"),
        };
        let mut merged = toml::Table::try_from(Self::default()).context("serialising the default config")?;
        overlay(&mut merged, given);
        let cfg: Self = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| anyhow::anyhow!("{}", e.message().trim()))
            .with_context(|| format!("parsing config {source}"))?;
        Ok(Self { batch_keys_given, ..cfg })
    }

    /// The trained model's own batch key's value (`dqn.batch_size`, `ppo.minibatch_size` or
    /// `seq.batch_size`).
    pub fn batch_key_value(&self) -> usize {
        match self.model {
            ModelChoice::Dqn => self.dqn.batch_size,
            ModelChoice::Ppo => self.ppo.minibatch_size,
            ModelChoice::Tft | ModelChoice::Mamba2 => self.seq.batch_size,
        }
    }

    /// Sets the trained model's own batch key.
    pub fn set_batch_key(&mut self, n: usize) {
        match self.model {
            ModelChoice::Dqn => self.dqn.batch_size = n,
            ModelChoice::Ppo => self.ppo.minibatch_size = n,
            ModelChoice::Tft | ModelChoice::Mamba2 => self.seq.batch_size = n,
        }
    }

    /// A saved run's config as it continues: its batch is the number it used (a config.toml
    /// written before `batch` existed has no such key: its model key is that number).
    pub fn pinned_batch(mut self) -> Self {
        if self.batch == crate::batch::BatchSize::Auto {
            self.batch = crate::batch::BatchSize::Fixed(self.batch_key_value());
        }
        self.batch_source = crate::batch::BatchSource::Config;
        self
    }

    /// Whether the config file set the trained model's own batch key.
    pub fn model_key_given(&self) -> bool {
        match self.model {
            ModelChoice::Dqn => self.batch_keys_given.dqn,
            ModelChoice::Ppo => self.batch_keys_given.ppo,
            ModelChoice::Tft | ModelChoice::Mamba2 => self.batch_keys_given.seq,
        }
    }

    /// The config as TOML (every field written out).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).context("serialising the run config")
    }

    /// Applies `FX_DEVICE`, `FX_PRECISION` and `FX_BATCH_SIZE` (through fx-hw, which
    /// validates them). Callers apply them after the config file and before command-line
    /// flags, so flags > environment > config file > defaults. `FX_BATCH_SIZE` sets the
    /// batch of whichever model the run trains.
    pub fn apply_env_overrides(&mut self, env: &fx_hw::Overrides) {
        if let Some(d) = &env.device {
            self.device = match d.value {
                fx_hw::DeviceRequest::Auto => "auto".to_string(),
                fx_hw::DeviceRequest::Cpu => "cpu".to_string(),
                fx_hw::DeviceRequest::Cuda(n) => format!("cuda:{n}"),
            };
        }
        if let Some(p) = &env.precision {
            self.precision = p.value;
        }
        if let Some(b) = &env.batch_size {
            self.batch = crate::batch::BatchSize::Fixed(b.value);
            self.batch_source = crate::batch::BatchSource::Env;
        }
    }

    /// Spreads the run-level settings (seed, precision, env seed) into the model configs
    /// and checks what can be checked before any work starts.
    pub fn resolve(mut self) -> Result<Self> {
        // A numeric batch sets the model's key now, so the size checks below see it; "auto"
        // is settled once the device (and, for the sequence models, the data) is known.
        if let crate::batch::BatchSize::Fixed(n) = self.batch {
            // One file setting both `batch` and the model's own key to different values is
            // ambiguous: refuse it rather than pick one (a flag or FX_BATCH_SIZE wins over
            // both, by design).
            if self.batch_source == crate::batch::BatchSource::Config
                && self.model_key_given()
                && self.batch_key_value() != n
            {
                bail!(
                    "the config sets batch = {n} and {} = {}: keep one of them",
                    crate::batch::model_key_name(self.model),
                    self.batch_key_value()
                );
            }
            self.set_batch_key(n);
        }
        self.env.seed = self.seed;
        self.synthetic.seed = self.data_seed.unwrap_or(self.seed);
        self.dqn.seed = self.seed;
        self.ppo.seed = self.seed;
        self.dqn.precision = self.precision;
        self.ppo.precision = self.precision;
        self.dqn.graph = self.graph;
        self.ppo.graph = self.graph;
        self.seq.seed = self.seed;
        self.seq.precision = self.precision;
        self.seq.graph = self.graph;
        // The feature widths are the data's (every feature file has them, checked on load).
        self.tft.n_observed = fx_kernels::N_MARKET;
        self.tft.n_known = fx_data::features::N_KNOWN;
        self.mamba2.n_in = fx_kernels::N_MARKET;
        if self.model.is_sequence() && (self.seq.epochs == 0 || self.seq.batch_size == 0) {
            bail!("seq.epochs and seq.batch_size must be at least 1");
        }
        if self.model == ModelChoice::Mamba2 && self.mamba2_seq_len == 0 {
            bail!("mamba2_seq_len must be at least 1");
        }
        // Each model's values, refused by key before anything is written.
        match self.model {
            ModelChoice::Tft => self.tft.validate()?,
            ModelChoice::Mamba2 => self.mamba2.validate()?,
            ModelChoice::Dqn => self.dqn.validate()?,
            ModelChoice::Ppo => self.ppo.validate(self.env.num_envs)?,
        }
        if self.steps == 0 {
            bail!("steps must be at least 1");
        }
        if self.warm_start && self.walk_forward.is_none() {
            bail!("warm_start (--warm-start) carries weights from fold to fold: give --folds too");
        }
        if self.population {
            if self.walk_forward.is_none() && self.seeds < 2 {
                bail!("population (--population) trains a study's runs together: give --folds or --seeds too");
            }
            if self.model.is_sequence() {
                bail!("population (--population) trains DQN and PPO studies, not {} ones", self.model.as_str());
            }
            if self.warm_start {
                bail!(
                    "population (--population) trains every fold at once: a warm start needs the previous fold first"
                );
            }
        }
        // An "auto" batch is checked once it is a number (the run resolves it on its device,
        // within the same bounds, then calls this again).
        if self.batch != crate::batch::BatchSize::Auto || self.model_key_given() {
            self.check_agent_sizes()?;
        }
        self.check_host_memory()?;
        if self.checkpoint_every == 0 || self.log_every == 0 {
            bail!("checkpoint_every and log_every must be at least 1");
        }
        if self.keep_checkpoints == 0 {
            bail!("keep_checkpoints must be at least 1");
        }
        if let Some(p) = self.periods_per_year {
            if !(p.is_finite() && p > 0.0) {
                bail!("periods_per_year must be positive, got {p}");
            }
        }
        Ok(self)
    }

    /// Sizes that cannot work for the RL agents, refused before anything is written.
    fn check_agent_sizes(&self) -> Result<()> {
        match self.model {
            ModelChoice::Dqn => {
                let (b, cap) = (self.dqn.batch_size, self.dqn.replay_capacity);
                if b > cap {
                    bail!("dqn.batch_size {b} exceeds dqn.replay_capacity {cap}: minibatches are drawn from the replay buffer");
                }
            }
            ModelChoice::Ppo => {
                let rollout = self.ppo.num_steps.saturating_mul(self.env.num_envs);
                if self.ppo.minibatch_size > rollout {
                    bail!(
                        "ppo.minibatch_size {} exceeds the rollout's ppo.num_steps × env.num_envs = {rollout} rows",
                        self.ppo.minibatch_size
                    );
                }
            }
            ModelChoice::Tft | ModelChoice::Mamba2 => {}
        }
        Ok(())
    }

    /// What a run holds in host memory, by the key that sizes it (bytes): the network's
    /// parameters with their gradient, AdamW moments and target / snapshot / best copies; for
    /// DQN / PPO the replay buffer or rollout, a minibatch's activations and the accounts'
    /// state and observations; for TFT / MAMBA-2 one batch's activations over its windows.
    /// Estimates on the generous side.
    pub fn host_memory_needs(&self) -> Vec<(String, u64)> {
        self.memory_needs(self.activations_on_host())
    }

    /// What a run on a GPU holds in device memory, by key (bytes): the same buffers as
    /// [`Self::host_memory_needs`] (parameters and optimiser state, replay or rollout, the
    /// accounts and a DQN / PPO minibatch's activations all live on the device there),
    /// except a forecaster's batch activations, which the budget's batch sizing bounds (and
    /// an out-of-memory at start-up retries a tier down).
    pub fn device_memory_needs(&self) -> Vec<(String, u64)> {
        self.memory_needs(false)
    }

    /// Refuses a GPU run whose [`Self::device_memory_needs`] exceed the device's free memory
    /// (`free` bytes on `device`, as the driver reports them once it is open): one line
    /// naming the key that needs most, before any of it is allocated.
    pub fn check_device_memory(&self, free: u64, device: &str) -> Result<()> {
        refuse_beyond(&self.device_memory_needs(), free, |key, most, total, free| {
            format!(
                "{key} needs {most:.1} GiB of device memory ({total:.1} GiB for the run in all), \
                 more than {device} has free ({free:.1} GiB)"
            )
        })
    }

    /// [`Self::host_memory_needs`]; `seq_activations`: whether a forecaster's batch
    /// activations count.
    fn memory_needs(&self, seq_activations: bool) -> Vec<(String, u64)> {
        let count = |specs: Vec<fx_models::ParamSpec>| -> u64 {
            specs
                .iter()
                .map(|s| s.shape.iter().map(|&d| d as u64).fold(1u64, u64::saturating_mul))
                .fold(0, u64::saturating_add)
        };
        let f32s = |n: u64, copies: u64| n.saturating_mul(4).saturating_mul(copies);
        let obs = self.dqn.net.state_dim as u64;
        // State, position, entry, counters, and two observations per account.
        let per_account = obs.saturating_mul(8).saturating_add(64);
        let mut needs = vec![("env.num_envs".to_string(), (self.env.num_envs as u64).saturating_mul(per_account))];
        match self.model {
            ModelChoice::Dqn => {
                let n = &self.dqn.net;
                let p = count(n.param_specs());
                needs.push((format!("dqn.net.hidden {} ({p} parameters)", n.hidden), f32s(p, 7)));
                // States and next states (f32 × state_dim each), action, reward, done; a
                // checkpoint also copies the buffer to host memory.
                let per = obs.saturating_mul(2).saturating_add(3).saturating_mul(4);
                needs.push((
                    format!("dqn.replay_capacity {} ({per} bytes a transition)", self.dqn.replay_capacity),
                    (self.dqn.replay_capacity as u64).saturating_mul(per),
                ));
                let acts = (self.dqn.batch_size as u64).saturating_mul(n.hidden as u64).saturating_mul(3 * 3 * 2);
                needs.push((format!("dqn.batch_size {}", self.dqn.batch_size), f32s(acts, 1)));
            }
            ModelChoice::Ppo => {
                let n = &self.ppo.net;
                let p = count(n.param_specs());
                needs.push((format!("ppo.net.hidden {} ({p} parameters)", n.hidden), f32s(p, 6)));
                let rows = (self.ppo.num_steps as u64).saturating_mul(self.env.num_envs as u64);
                needs.push((
                    format!("ppo.num_steps {} x env.num_envs {}", self.ppo.num_steps, self.env.num_envs),
                    f32s(rows, obs.saturating_add(8)),
                ));
                let acts = (self.ppo.minibatch_size as u64).saturating_mul(n.hidden as u64).saturating_mul(2 * 2 * 2);
                needs.push((format!("ppo.minibatch_size {}", self.ppo.minibatch_size), f32s(acts, 1)));
            }
            ModelChoice::Tft => {
                // The accounts are not used; the sizes are the network's (an upper estimate of
                // its parameters: a gated residual network of ~5 d×d maps per variable and the
                // selection over all of them, the LSTMs, attention and the static GRNs) and one
                // batch's activations over its windows (the taped forward keeps about a dozen
                // d-wide values per variable and step).
                let t = &self.tft;
                needs.clear();
                let (d, vars) = (t.d as u64, (t.n_observed + t.n_known).max(1) as u64);
                let p = d.saturating_mul(d).saturating_mul(vars.saturating_mul(8).saturating_add(48));
                needs.push((format!("tft.d {} (about {p} parameters)", t.d), f32s(p, 6)));
                let steps = (t.l_enc as u64).saturating_add(t.h as u64);
                let per = steps.saturating_mul(d).saturating_mul(vars.saturating_mul(12).saturating_add(40));
                if seq_activations {
                    let acts = (self.seq.batch_size as u64).saturating_mul(per);
                    let key = format!("seq.batch_size {} x tft.l_enc + tft.h {steps}", self.seq.batch_size);
                    needs.push((key, f32s(acts, 1)));
                }
            }
            ModelChoice::Mamba2 => {
                let m = &self.mamba2;
                needs.clear();
                let (dm, layers) = (m.d_model as u64, m.n_layer as u64);
                let inner = (m.expand as u64).saturating_mul(dm);
                let gn = 2u64.saturating_mul(m.ngroups as u64).saturating_mul(m.d_state as u64);
                let heads = inner / (m.headdim as u64).max(1);
                let per_layer = dm
                    .saturating_mul(inner.saturating_mul(3).saturating_add(gn).saturating_add(heads))
                    .saturating_add(inner.saturating_add(gn).saturating_mul(m.d_conv as u64));
                let p = layers.saturating_mul(per_layer).saturating_add((m.n_in as u64).saturating_mul(dm));
                needs.push((
                    format!("mamba2.d_model {} x n_layer {} (about {p} parameters)", m.d_model, m.n_layer),
                    f32s(p, 6),
                ));
                let per = (self.mamba2_seq_len as u64)
                    .saturating_mul(layers)
                    .saturating_mul(inner.saturating_mul(12).saturating_add(gn.saturating_mul(4)));
                if seq_activations {
                    let acts = (self.seq.batch_size as u64).saturating_mul(per);
                    let key =
                        format!("seq.batch_size {} x mamba2_seq_len {}", self.seq.batch_size, self.mamba2_seq_len);
                    needs.push((key, f32s(acts, 1)));
                }
            }
        }
        needs
    }

    /// Whether a forecaster's batch activations live in host memory: on the CPU (or `auto`
    /// in a build without CUDA). On a GPU they are the device's, which the batch sizing
    /// (`fx-hw`'s budget) bounds instead.
    fn activations_on_host(&self) -> bool {
        self.device == "cpu" || (!cfg!(feature = "cuda") && self.device == "auto")
    }

    /// Refuses a run whose [`Self::host_memory_needs`] exceed half of what the process may
    /// use (the machine's memory, or a smaller address-space limit such as a container's
    /// `ulimit -v`): one line naming the key that needs most, before anything is allocated
    /// (an allocation that large would abort the process instead).
    fn check_host_memory(&self) -> Result<()> {
        let Some((limit, what)) = fx_hw::HostInfo::detect().memory_limit() else { return Ok(()) };
        refuse_beyond(&self.host_memory_needs(), limit / 2, |key, most, total, _| {
            let limit = limit as f64 / (1u64 << 30) as f64;
            format!("{key} needs {most:.1} GiB ({total:.1} GiB for the run in all), more than half of {what} ({limit:.1} GiB)")
        })
    }
}

/// The one rule of both memory checks: `needs` (bytes by key) in all above `budget` is
/// refused, in one line from `say(key that needs most, its GiB, all GiB, budget GiB)`.
fn refuse_beyond(needs: &[(String, u64)], budget: u64, say: impl Fn(&str, f64, f64, f64) -> String) -> Result<()> {
    let total: u64 = needs.iter().map(|(_, b)| *b).fold(0, u64::saturating_add);
    let Some((key, most)) = needs.iter().max_by_key(|(_, b)| *b) else { return Ok(()) };
    if total > budget {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        bail!("{}", say(key, gib(*most), gib(total), gib(budget)));
    }
    Ok(())
}

/// A TOML error as one line, `line L, column C: what`: the toml crate's own message is a
/// multi-line snippet that quotes the file raw (a stray carriage return in it would garble
/// the terminal line), so its lines are joined and control characters escaped.
/// `given`'s keys over `base`, table inside table (arrays and values replace).
fn overlay(base: &mut toml::Table, given: toml::Table) {
    for (k, v) in given {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(g)) => overlay(b, g),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

fn toml_error(text: &str, e: &toml::de::Error) -> anyhow::Error {
    let escaped = |s: &str| -> String {
        s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
    };
    let what: Vec<&str> = e.message().lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let what = escaped(&what.join("; "));
    match e.span().and_then(|s| text.get(..s.start)) {
        Some(before) => {
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            if what.is_empty() {
                // toml says nothing more for e.g. a key without a value: quote the line.
                let text: String = text.lines().nth(line - 1).unwrap_or("").chars().take(80).collect();
                anyhow::anyhow!("line {line}, column {column}: invalid TOML (`{}`)", escaped(&text))
            } else {
                anyhow::anyhow!("line {line}, column {column}: {what}")
            }
        }
        None if what.is_empty() => anyhow::anyhow!("invalid TOML"),
        None => anyhow::anyhow!("{what}"),
    }
}

#[cfg(test)]
pub(crate) mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_overrides_reach_the_run() {
        let env = fx_hw::Overrides::from_vars(|k| match k {
            "FX_DEVICE" => Some("cpu".into()),
            "FX_PRECISION" => Some("bf16".into()),
            "FX_BATCH_SIZE" => Some("96".into()),
            _ => None,
        })
        .unwrap();
        let mut cfg = RunConfig::default();
        cfg.apply_env_overrides(&env);
        assert_eq!((cfg.batch, cfg.batch_source), (crate::batch::BatchSize::Fixed(96), crate::batch::BatchSource::Env));
        let cfg = cfg.resolve().unwrap();
        assert_eq!((cfg.device.as_str(), cfg.precision, cfg.dqn.batch_size), ("cpu", Precision::Bf16, 96));
        let mut ppo = RunConfig { model: ModelChoice::Ppo, ..RunConfig::default() };
        ppo.apply_env_overrides(&env);
        assert_eq!(ppo.resolve().unwrap().ppo.minibatch_size, 96);
    }

    #[test]
    fn a_config_file_records_which_batch_keys_it_sets() {
        let dir = std::env::temp_dir().join(format!("fx-batch-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        std::fs::write(&path, "model = \"ppo\"\n[ppo]\nminibatch_size = 128\n").unwrap();
        let cfg = RunConfig::from_toml_file(&path).unwrap();
        assert!(cfg.model_key_given() && cfg.batch_keys_given.ppo && !cfg.batch_keys_given.dqn);
        assert_eq!(cfg.batch, crate::batch::BatchSize::Auto);
        std::fs::write(&path, "batch = 640\n").unwrap();
        let cfg = RunConfig::from_toml_file(&path).unwrap();
        assert!(!cfg.model_key_given());
        assert_eq!(cfg.resolve().unwrap().dqn.batch_size, 640);
        // Both in one file, different: refused, naming both; equal (a saved config.toml): fine.
        std::fs::write(&path, "batch = 640\n[dqn]\nbatch_size = 32\n").unwrap();
        let e = RunConfig::from_toml_file(&path).unwrap().resolve().unwrap_err().to_string();
        assert!(e.contains("batch = 640") && e.contains("dqn.batch_size = 32"), "{e}");
        std::fs::write(&path, "batch = 32\n[dqn]\nbatch_size = 32\n").unwrap();
        assert_eq!(RunConfig::from_toml_file(&path).unwrap().resolve().unwrap().dqn.batch_size, 32);
        // An "auto" batch is size-checked once it is a number: a rollout smaller than the
        // default minibatch is no error yet (the run bounds auto by the rollout).
        std::fs::write(&path, "model = \"ppo\"\n[env]\nnum_envs = 4\n").unwrap();
        assert!(RunConfig::from_toml_file(&path).unwrap().resolve().is_ok());
        std::fs::write(&path, "model = \"ppo\"\n[env]\nnum_envs = 4\n[ppo]\nnum_steps = 64\nminibatch_size = 512\n")
            .unwrap();
        assert!(RunConfig::from_toml_file(&path).unwrap().resolve().is_err(), "an explicit key is checked at once");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn toml_round_trip_keeps_every_field() {
        let cfg = RunConfig::default();
        let text = cfg.to_toml().unwrap();
        let back: RunConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn partial_toml_fills_defaults_and_unknown_keys_fail() {
        let cfg: RunConfig = toml::from_str("model = \"ppo\"\nsteps = 10\n").unwrap();
        assert_eq!(cfg.model, ModelChoice::Ppo);
        assert_eq!(cfg.env, RunConfig::default().env);
        assert!(toml::from_str::<RunConfig>("stepz = 10\n").is_err());
        // Typos inside nested tables are errors too, not silently ignored settings.
        for bad in
            ["[env]\nnum_env = 3\n", "[seq]\nepoch = 3\n", "[dqn.optimizer]\nlr_ = 1.0\n", "[split]\ntrian = 0.5\n"]
        {
            assert!(toml::from_str::<RunConfig>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_section_with_one_key_changes_only_that_key() {
        let plain = RunConfig::default();
        type Case = (&'static str, fn(&mut RunConfig));
        let cases: [Case; 4] = [
            ("[dqn]\ngamma = 0.25\n", |c| c.dqn.gamma = 0.25),
            ("[dqn.optimizer]\nlr = 3e-4\n", |c| c.dqn.optimizer.lr = 3e-4),
            ("model = \"tft\"\n[tft]\nd = 8\n", |c| {
                c.model = ModelChoice::Tft;
                c.tft.d = 8;
            }),
            ("[ppo]\nepochs = 3\n[env]\ncost = 0.001\n", |c| {
                c.ppo.epochs = 3;
                c.env.cost = 0.001;
            }),
        ];
        for (text, change) in cases {
            let got = RunConfig::from_toml_str(text, "test").unwrap();
            let mut want = plain.clone();
            change(&mut want);
            // As a plain run's config.toml would be, but for the key.
            assert_eq!(got.to_toml().unwrap(), want.to_toml().unwrap(), "{text}");
        }
        // Errors still name the file's line.
        let e = RunConfig::from_toml_str("steps = 3\n[dqn]\ngama = 0.5\n", "f.toml").unwrap_err();
        assert!(format!("{e:#}").contains("parsing config f.toml: line 3"), "{e:#}");
    }

    /// TFT / MAMBA-2 dimensions that cannot build are refused at resolve time, one line
    /// naming the key and the value; DQN's and PPO's values too (they were refused only
    /// when the trainer was built, after a sweep or study had made its folder).
    #[test]
    fn forecaster_dimensions_that_cannot_work_are_refused_by_key() {
        for (model, section, want) in [
            ("tft", "[tft]\nd = 16\nn_head = 3\n", "n_head (3) must divide d (16)"),
            ("tft", "[tft]\nquantiles = [0.9, 0.1]\n", "quantiles [0.9, 0.1] must be"),
            ("tft", "[tft]\nquantiles = [0.5, 1.0]\n", "inside (0, 1)"),
            ("tft", "[tft]\ndropout = 1.0\n", "dropout (1) must be in [0, 1)"),
            ("tft", "[tft]\nln_eps = -1.0\n", "ln_eps (-1) must be finite and positive"),
            ("tft", "[tft]\nH = 0\n", "H (0) must be at least 1"),
            ("mamba2", "[mamba2]\nheaddim = 7\n", "headdim (7) must divide"),
            ("mamba2", "[mamba2]\nngroups = 3\n", "ngroups (3) must divide"),
            ("mamba2", "[mamba2]\nchunk_size = 0\n", "chunk_size (0) must be at least 1"),
            ("mamba2", "[mamba2]\nnorm_eps = nan\n", "norm_eps (NaN) must be finite and positive"),
            ("dqn", "[dqn.optimizer]\nlr = 0.0\n", "optimizer.lr (0) must be finite and positive"),
            ("dqn", "[dqn]\ngamma = 1.5\n", "gamma (1.5) must be in [0, 1]"),
            ("dqn", "[dqn.epsilon]\nend = -0.1\n", "epsilon.end (-0.1)"),
            ("ppo", "[ppo.gae]\nlambda = 2.0\n", "gae.lambda (2) must be in [0, 1]"),
            ("ppo", "[ppo.gae]\ngamma = nan\n", "gae.gamma (NaN)"),
            ("ppo", "[ppo.loss]\nclip = 0.0\n", "loss.clip (0)"),
        ] {
            let cfg = RunConfig::from_toml_str(&format!("model = \"{model}\"\n{section}"), "f.toml").unwrap();
            let e = format!("{:#}", cfg.resolve().unwrap_err());
            assert!(e.contains(want) && e.contains(model) && !e.contains('\n'), "{section:?}: {e}");
        }
    }

    #[test]
    fn configs_beyond_the_machines_memory_are_refused_before_allocating() {
        let mut huge_net = RunConfig::default();
        huge_net.dqn.net.hidden = 200_000;
        let e = format!("{:#}", huge_net.resolve().unwrap_err());
        assert!(e.contains("dqn.net.hidden 200000") && e.contains("more than half of"), "{e}");
        let mut huge_envs = RunConfig { model: ModelChoice::Ppo, ..RunConfig::default() };
        huge_envs.env.num_envs = 2_000_000_000;
        huge_envs.ppo.num_steps = 1;
        let e = format!("{:#}", huge_envs.resolve().unwrap_err());
        assert!(e.contains("env.num_envs") || e.contains("ppo.num_steps 1 x env.num_envs"), "{e}");
        assert!(RunConfig::default().resolve().is_ok());
        let needs = RunConfig::default().host_memory_needs();
        assert!(needs.iter().any(|(k, b)| k.starts_with("dqn.replay_capacity") && *b > 0), "{needs:?}");
        // On a GPU the same buffers are checked against the device's free memory: the plain
        // runs fit a 4 GiB laptop card; a replay beyond a 80 GiB card is refused naming it.
        const GIB: u64 = 1 << 30;
        for model in [ModelChoice::Dqn, ModelChoice::Ppo, ModelChoice::Tft, ModelChoice::Mamba2] {
            let plain = RunConfig { model, device: "cuda".into(), ..RunConfig::default() };
            plain.check_device_memory(4 * GIB, "cuda:0").unwrap();
        }
        let mut big = RunConfig { device: "cuda".into(), ..RunConfig::default() };
        big.dqn.replay_capacity = 250_000_000;
        let e = format!("{:#}", big.check_device_memory(80 * GIB, "cuda:0 (H100)").unwrap_err());
        assert!(
            e.contains("dqn.replay_capacity 250000000")
                && e.contains("cuda:0 (H100) has free (80.0 GiB)")
                && !e.contains('\n'),
            "{e}"
        );
        big.check_device_memory(u64::MAX, "cuda:0").unwrap();
        // The forecasters: a width, a depth or a batch beyond the machine names its key; the
        // plain configs pass.
        for (model, edit, key) in [
            (ModelChoice::Tft, "[tft]\nd = 100000\n", "tft.d 100000"),
            (ModelChoice::Tft, "[seq]\nbatch_size = 100000000\n", "seq.batch_size 100000000"),
            (ModelChoice::Mamba2, "[mamba2]\nd_model = 1000000\n", "mamba2.d_model 1000000"),
            (ModelChoice::Mamba2, "mamba2_seq_len = 1000000000\n", "mamba2_seq_len 1000000000"),
        ] {
            let name = if model == ModelChoice::Tft { "tft" } else { "mamba2" };
            let head = format!("model = \"{name}\"\ndevice = \"cpu\"\n");
            let plain = RunConfig::from_toml_str(&head, "plain.toml").unwrap();
            assert!(plain.resolve().is_ok(), "the plain {name} config is refused");
            let cfg = RunConfig::from_toml_str(&format!("{head}{edit}"), "big.toml").unwrap();
            let e = format!("{:#}", cfg.resolve().unwrap_err());
            assert!(e.contains(key) && e.contains("more than half of") && !e.contains('\n'), "{name} {edit:?}: {e}");
        }
    }
}
