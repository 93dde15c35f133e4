//! `fx-train sweep --config sweep.toml --out DIR`: many DQN or PPO trials trained together as
//! one population ([`fx_models::DqnPopulation`]: one batched step for every trial, each trial
//! its own seed, environments, replay and hyperparameters; [`fx_models::PpoPopulation`]: whole
//! iterations of every trial, each its own environments, rollout, GAE and hyperparameters),
//! ranked by a validation-split metric; the best trials are then trained again as ordinary runs (their run folders hold
//! config, checkpoint and report, so `eval`, `quantize` and `--resume` work on them, and the
//! test split is scored there, for those trials only).
//!
//! The sweep file: `trials`, `seed` (the sampler's), `sampler` (`grid`, `random`, `sobol`,
//! `tpe`),
//! `best` (how many trials get run folders), `[run]` (a run config, the `train --config`
//! format: every trial's base) and `[space]` (dotted run-config keys, each
//! `{ choice = [...] }`, `{ uniform = [lo, hi] }`, `{ log_uniform = [lo, hi] }` or
//! `{ int = [lo, hi] }`) and `members` (the most trials in one population). Trials whose
//! shape keys differ (network width, batch, replay, update schedule:
//! [`DqnPopulation::shape_key`], [`PpoPopulation::shape_key`] and the number of accounts)
//! train in separate populations; a group with more trials than
//! the device holds (`fx_hw::HardwareBudget::population_size` from the member's estimated
//! memory, or `members`, or `FX_POPULATION`) trains in waves. A member is its solo run, so a
//! trial's result does not depend on its wave.
//!
//! TFT and MAMBA-2 sweeps train their trials one after another ([`train_seq_trials`]): each
//! trial an ordinary run in `trials/trial-{k}` reporting on the validation split only
//! (`RunConfig::validation_only`), ranked by its best epoch's validation loss, resumed from
//! its last epoch's checkpoint when a stopped sweep starts again. Not as populations: their
//! fused steps are one model's captured graph; member-batched attention, variable selection
//! and scans are not built.
//!
//! `[halving]` ([`halving`]) stops the worse trials at rungs: forecaster trials at rungs of
//! epochs (each paused with its full schedule, [`halve`]; a trial whose training goes
//! non-finite is recorded as diverged and the sweep goes on), DQN and PPO trials at rungs of
//! their own env steps by ASHA's rule ([`PopHalving`]). A group of one shape is then one
//! population of `members` slots whose freed slots take the next waiting trial at step 0
//! (`DqnPopulation::replace_member`, `PpoPopulation::replace_member`: between iterations),
//! dropped once none waits. Rungs, PBT rounds and a wave's end score the members' greedy
//! policies on the validation split on the machine's cores ([`score_policies`]).
//!
//! `sampler = "tpe"` with `[tpe]` (`startup`, default 16; `batch`, default `startup`;
//! `explore`, default 0.2) runs the trials in rounds ([`tpe`]): the first `startup` on Sobol
//! points, each later round of `batch` proposed by the tree-structured Parzen estimator from
//! every finished trial's validation Sharpe (`explore` of it drawn uniformly). A round trains as one population (in waves if the device needs them);
//! a restart recomputes the same proposals from the same rows. Not sharded, not with `[pbt]`.
//!
//! `[pbt]` (`every`, `quantile`, `factors`; DQN) makes each wave a population-based training
//! run ([`pbt`]): every `every` env steps the bottom members continue from copies of the top
//! ones with perturbed γ / τ / learning rate / weight decay / clip norm, each trial's row
//! records its copies, and the best trials' final weights are scored on the test split in
//! `sweep.json` (an ordinary run would not replay the schedule). There a trial's result
//! depends on the wave it trained in (`population.json` records the waves), and a PBT sweep
//! is not sharded. PBT selects on the validation split, the same split that ranks the
//! trials: the validation Sharpe of a PBT sweep is optimistic, its test Sharpe is not.
//!
//! Scale-out without a scheduler of our own: `--shard I/N` (or a SLURM array's task, or a
//! Kubernetes Indexed Job's `JOB_COMPLETION_INDEX` with the file's `shards`) trains the trials
//! whose index is I modulo N in its own folder (no best-trial runs there), and
//! `fx-train sweep --report DIR... [--out MERGED]` merges the shards' rows into the one
//! leaderboard (and, with `--out`, the merged rows and the best trials' runs).
//!
//! Outputs in DIR: `sweep.toml` (the file as run), `trials.jsonl` and `trials.csv` (one row per
//! trial: its point, validation metric and backtest, updates, skips, status), `sweep.json`
//! (how many trials were tried, the sampler, the populations, the leaderboard),
//! `population.json` (per wave: its trials, members, where that size came from, device,
//! training seconds and throughput), `tensorboard/trial-{k}/` (each trial's scalars,
//! [`write_tensorboard`]), `weights/trial-{k}.safetensors` (every trial's final
//! online network) and `best-{rank}/` run folders (on the CPU a best run ends with its
//! trial's weights exactly). The folder is locked while the sweep runs. Rows are written
//! after each wave: a sweep stopped by a signal (or killed) keeps its finished waves and the
//! same command goes on with the rest; the DQN / PPO wave in flight goes on from its
//! checkpoint (`waves/`, [`wave_state`]: written when stopped and every `checkpoint_minutes`);
//! a sweep whose rows are complete is not trained again, and running it again prints its
//! leaderboard and finishes any best-trial run that did not end.

mod halving;
mod pbt;
mod space;
mod tpe;
mod wave_state;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use fx_kernels::VecEnv;
use fx_models::{ActorCritic, DqnConfig, DqnPopulation, DuelingDqn, PpoConfig, PpoPopulation};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{ModelChoice, RunConfig};
use crate::dataset::Dataset;
use crate::lifecycle::Outcome;
use crate::population::{dqn_member_policy, ppo_member_policy};
use crate::train_env::TrainEnv;
pub use halving::HalvingConfig;
pub use pbt::{PbtConfig, PbtEvent};
pub use space::{Dim, Sampler};
pub use tpe::TpeConfig;
use wave_state::WaveProgress;

/// Flags of `fx-train sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// The sweep file (see the module docs and the README).
    #[arg(long, required_unless_present = "report")]
    pub config: Option<PathBuf>,
    /// The sweep's folder (with `--report`: where the merged leaderboard, rows and best
    /// runs go; none: the leaderboard is only printed).
    #[arg(long, required_unless_present = "report")]
    pub out: Option<PathBuf>,
    /// This process's share of the trials, `I/N` (0 ≤ I < N): the trials whose index is I
    /// modulo N, in a folder of their own. Without it, SLURM arrays
    /// (`SLURM_ARRAY_TASK_ID` − `SLURM_ARRAY_TASK_MIN` of `SLURM_ARRAY_TASK_COUNT`) and
    /// Kubernetes Indexed Jobs (`JOB_COMPLETION_INDEX` of the file's `shards`) set it.
    #[arg(long, conflicts_with = "report")]
    pub shard: Option<String>,
    /// Merges the shard folders of one sweep into one leaderboard (and, with `--out`, one
    /// set of rows and the best trials' runs).
    #[arg(long, num_args = 1.., conflicts_with_all = ["config", "shard"])]
    pub report: Vec<PathBuf>,
    /// Trials to run (overrides the file's `trials`).
    #[arg(long)]
    pub trials: Option<usize>,
    /// Environment steps of every trial (overrides `run.steps`; DQN and PPO).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Epochs of every trial (overrides `run.seq.epochs`; TFT and MAMBA-2).
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Device: auto, cpu, cuda, cuda:N (overrides `run.device`).
    #[arg(long)]
    pub device: Option<String>,
    /// The most trials trained at once (overrides the file's `members`; default: as many
    /// as the device's free memory holds).
    #[arg(long)]
    pub members: Option<usize>,
}

/// The sweep file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    /// Trials to draw (a grid: at most this many of its combinations; none: all of them).
    #[serde(default)]
    pub trials: Option<usize>,
    /// Seed of the sampler.
    #[serde(default)]
    pub seed: u64,
    /// How points are drawn.
    #[serde(default)]
    pub sampler: Sampler,
    /// Trials trained again as ordinary runs (run folders `best-1`, ...).
    #[serde(default = "one")]
    pub best: usize,
    /// The most trials in one population (default: what the device's free memory holds,
    /// `fx_hw::HardwareBudget::population_size`; `FX_POPULATION` overrides both); more trials
    /// run in waves.
    #[serde(default)]
    pub members: Option<usize>,
    /// Shards of a Kubernetes Indexed Job (`JOB_COMPLETION_INDEX` picks this process's;
    /// see `--shard`).
    #[serde(default)]
    pub shards: Option<usize>,
    /// Every trial's base run config.
    #[serde(default)]
    pub run: toml::Table,
    /// The search space: dotted run-config key → dimension.
    #[serde(default)]
    pub space: BTreeMap<String, Dim>,
    /// Population-based training of each DQN wave (none: every trial trains as it started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pbt: Option<PbtConfig>,
    /// The TPE sampler's rounds (`sampler = "tpe"`; none: its defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpe: Option<TpeConfig>,
    /// Successive halving of the trials ([`halving`]; none: every trial trains to
    /// the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halving: Option<HalvingConfig>,
    /// Minutes of a DQN / PPO wave's training between its checkpoints (default 10; 0: only
    /// when the sweep is stopped). A stopped sweep always checkpoints the wave in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_minutes: Option<f64>,
}

fn one() -> usize {
    1
}

/// One trial's row of `trials.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrialRow {
    pub trial: usize,
    /// The point: dotted key → value.
    pub params: BTreeMap<String, serde_json::Value>,
    /// The objective: the greedy policy's Sharpe ratio on the validation split (`null`
    /// where it is not finite).
    #[serde(with = "nan_as_null")]
    pub val_sharpe: f64,
    #[serde(with = "nan_as_null")]
    pub val_total_return: f64,
    #[serde(with = "nan_as_null")]
    pub val_max_drawdown: f64,
    pub updates: u64,
    pub skipped_updates: u64,
    /// `ok`, or `diverged` (a non-finite objective or no applied update).
    pub status: String,
    /// A forecaster trial's objective: its best validation loss (none for DQN / PPO,
    /// whose objective is `val_sharpe`; a forecaster's `val_*` backtest fields are its
    /// forecasts' sign strategy on the validation split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// A forecaster trial's epochs trained: fewer than `seq.epochs` when successive halving
    /// stopped it (`status` = `stopped`; its `val_loss` is its best at that rung).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<usize>,
    /// Under PBT, each time this trial continued from another (`params` above is where it
    /// started; its last event's are the settings it ended with).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pbt: Vec<PbtEvent>,
    /// A DQN / PPO trial's env steps trained when successive halving stopped it (`status` =
    /// `stopped`; its `val_*` fields are its greedy policy's at that rung).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_steps: Option<u64>,
    /// Under successive halving of DQN / PPO trials, the validation Sharpe at each rung the
    /// trial reached before the end (the metric the rung ranked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rungs: Vec<RungScore>,
}

/// A DQN / PPO trial's validation Sharpe at a rung of successive halving.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RungScore {
    pub env_step: u64,
    #[serde(with = "nan_as_null")]
    pub val_sharpe: f64,
}

/// A float as JSON: a number, or `null` for NaN and infinities (read back as NaN), so a
/// diverged trial's row reads back.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

impl SweepConfig {
    /// The time between a wave's checkpoints (`checkpoint_minutes`, default 10; 0: none
    /// but the one when stopped).
    fn checkpoint_every(&self) -> Result<Option<std::time::Duration>> {
        let m = self.checkpoint_minutes.unwrap_or(10.0);
        if m == 0.0 {
            Ok(None)
        } else if let Some(d) = (m > 0.0).then(|| std::time::Duration::try_from_secs_f64(60.0 * m).ok()).flatten() {
            Ok(Some(d))
        } else {
            bail!("checkpoint_minutes = {m}: minutes between a wave's checkpoints are a number >= 0 (and below 1e17)")
        }
    }

    fn from_file(path: &Path) -> Result<Self> {
        let text = fx_data::files::read_regular_to_string(path, fx_data::files::MAX_TEXT_BYTES)
            .with_context(|| format!("reading sweep file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("parsing sweep file {}: {}", path.display(), e.message()))
    }
}

/// Sets the dotted `key` of `table` to `value`, making tables on the way.
fn set_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<()> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().filter(|l| !l.is_empty()).with_context(|| format!("space key {key:?} is empty"))?;
    let mut t = table;
    for p in parts {
        let entry = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry.as_table_mut().with_context(|| format!("space key {key}: {p} is not a table in the run config"))?;
    }
    t.insert(last.to_string(), value);
    Ok(())
}

/// The run config of each point: the base with the point's keys set, parsed strictly (a
/// misspelt key is an error naming the trial) and resolved.
fn trial_configs(spec: &SweepConfig, points: &[space::Point]) -> Result<Vec<RunConfig>> {
    points.iter().enumerate().map(|(i, p)| point_config(spec, p, i)).collect()
}

/// The run config of trial `i` at point `p` (see [`trial_configs`]).
fn point_config(spec: &SweepConfig, p: &space::Point, i: usize) -> Result<RunConfig> {
    let mut t = spec.run.clone();
    for (k, v) in p {
        set_dotted(&mut t, k, v.clone())?;
    }
    let text = toml::to_string(&t).context("writing a trial's config")?;
    match RunConfig::from_toml_str(&text, &format!("sweep trial {i}")) {
        Ok(cfg) => cfg.resolve().with_context(|| format!("sweep trial {i}")),
        Err(e) => {
            // The trial's text is generated: name the [space] key that broke it, not a line.
            for (k, v) in p {
                let mut one = spec.run.clone();
                set_dotted(&mut one, k, v.clone())?;
                if let Err(why) = RunConfig::from_toml_str(&toml::to_string(&one)?, "x") {
                    let why = format!("{why:#}");
                    let rule = why.rsplit(": ").next().unwrap_or(&why);
                    bail!("[space] key {k:?} = {v} (trial {i}): {rule}");
                }
            }
            Err(e)
        }
    }
}

/// Every trial sees the same market: the data follow the base config's seed, whatever a
/// trial's seed (which moves weights and environment draws).
fn on_base_market(cfgs: &mut [RunConfig], base: &RunConfig) {
    for c in cfgs {
        c.data_seed = Some(base.synthetic.seed);
        c.synthetic.seed = base.synthetic.seed;
        c.data.clone_from(&base.data);
    }
}

/// `fx-train sweep` (see the module docs); a signal stops it after the env step in flight,
/// keeping every finished wave (the same command goes on from there).
pub fn run(args: &SweepArgs) -> Result<Outcome> {
    crate::lifecycle::install_signal_handler();
    run_with(args, &mut crate::lifecycle::interrupted)
}

/// [`run`] with the stop check as a parameter (called once per env step).
fn run_with(args: &SweepArgs, stop: &mut dyn FnMut() -> bool) -> Result<Outcome> {
    if !args.report.is_empty() {
        return report(&args.report, args.out.as_deref());
    }
    let (Some(config), Some(out)) = (&args.config, &args.out) else {
        bail!("a sweep needs --config and --out (or --report DIR...)");
    };
    let mut spec = SweepConfig::from_file(config)?;
    if let Some(n) = args.trials {
        spec.trials = Some(n);
    }
    if let Some(s) = args.steps {
        spec.run.insert("steps".into(), toml::Value::Integer(s.try_into().context("--steps is too large")?));
    }
    if let Some(d) = &args.device {
        spec.run.insert("device".into(), toml::Value::String(d.clone()));
    }
    if let Some(e) = args.epochs {
        let seq = spec.run.entry("seq").or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let seq = seq.as_table_mut().context("the sweep's [run.seq] is not a table")?;
        seq.insert("epochs".into(), toml::Value::Integer(e.try_into().context("--epochs is too large")?));
    }
    if let Some(m) = args.members {
        spec.members = Some(m);
    }
    if spec.members == Some(0) {
        bail!("sweep file {}: members must be at least 1", config.display());
    }
    spec.checkpoint_every().with_context(|| format!("sweep file {}", config.display()))?;
    let space: Vec<(String, Dim)> = spec.space.clone().into_iter().collect();
    if spec.tpe.is_some() && spec.sampler != Sampler::Tpe {
        bail!("sweep file {}: a [tpe] section needs sampler = \"tpe\"", config.display());
    }
    let base = RunConfig::from_toml_str(&toml::to_string(&spec.run)?, "the sweep's [run]")?.resolve()?;
    match (base.model.is_sequence(), args.steps.is_some(), args.epochs.is_some()) {
        (true, true, _) => bail!("--steps is for DQN and PPO sweeps; a {} sweep takes --epochs", base.model.as_str()),
        (false, _, true) => {
            bail!("--epochs is for TFT and MAMBA-2 sweeps; a {} sweep takes --steps", base.model.as_str())
        }
        _ => {}
    }
    let shard = shard_of(args.shard.as_deref(), spec.shards, &|k| std::env::var(k).ok())?;
    if spec.sampler == Sampler::Tpe {
        return run_tpe(&spec, &space, &base, config, out, shard.is_some(), stop);
    }
    let points = space::sample(&space, spec.sampler, spec.trials, spec.seed)?;
    if points.is_empty() {
        bail!("the sweep has no trials");
    }
    let mut cfgs = trial_configs(&spec, &points)?;
    let perturbable: &[&str] = if base.model == ModelChoice::Ppo { &pbt::PERTURBABLE_PPO } else { &pbt::PERTURBABLE };
    if spec.pbt.is_some() && base.model.is_sequence() {
        bail!(
            "sweep file {}: [pbt] trains DQN and PPO populations, not {} trials (try [halving])",
            config.display(),
            base.model.as_str()
        );
    }
    let pbt_keys = spec.pbt.as_ref().map(|p| p.check(&space, perturbable)).transpose()?;
    if pbt_keys.is_some() && shard.is_some() {
        bail!("sweep file {}: a [pbt] sweep exploits across its whole population and is not sharded", config.display());
    }
    let plan = match (&spec.pbt, pbt_keys) {
        (Some(cfg), Some(keys)) => Some(PbtPlan { cfg, spec: &spec, space: &space, keys, points: &points }),
        _ => None,
    };
    if let Some(h) = &spec.halving {
        // Refused before the sweep's folder is made. Shards would halve among their own
        // trials (another leaderboard than the whole sweep's); PBT already moves the worst.
        if shard.is_some() || plan.is_some() {
            bail!("sweep file {}: [halving] ranks every trial of a population at each rung; it is not for shards or [pbt]", config.display());
        }
        if !base.model.is_sequence() {
            let rungs = h.step_rungs(base.steps).with_context(|| format!("sweep file {}", config.display()))?;
            // A DQN trial that takes a freed slot starts on its own update schedule only at a
            // multiple of train_every (`DqnPopulation::replace_member`).
            let every = base.dqn.train_every;
            if base.model != ModelChoice::Ppo && rungs.iter().any(|r| r % every != 0) {
                bail!(
                    "sweep file {}: [halving] rungs {rungs:?} must be multiples of dqn.train_every = {every} (a stopped trial's slot takes the next trial there); set min_steps and steps to multiples",
                    config.display()
                );
            }
            if let Some((t, c)) =
                cfgs.iter().enumerate().find(|(_, c)| c.dqn.train_every != every && base.model != ModelChoice::Ppo)
            {
                bail!(
                    "sweep file {}: [halving] needs one dqn.train_every for every trial; trial {t} has {}, [run] {every}",
                    config.display(),
                    c.dqn.train_every
                );
            }
            if let Some((t, c)) = cfgs.iter().enumerate().find(|(_, c)| c.steps != base.steps) {
                bail!(
                    "sweep file {}: [halving] needs one steps for every trial (the rungs); trial {t} has {}, [run] {}",
                    config.display(),
                    c.steps,
                    base.steps
                );
            }
        } else {
            h.rungs(base.seq.epochs).with_context(|| format!("sweep file {}", config.display()))?;
            if let Some((t, c)) = cfgs.iter().enumerate().find(|(_, c)| c.seq.epochs != base.seq.epochs) {
                bail!(
                    "sweep file {}: [halving] needs one seq.epochs for every trial (the rungs); trial {t} has {}, [run] {}",
                    config.display(),
                    c.seq.epochs,
                    base.seq.epochs
                );
            }
        }
    }
    let mine = |t: usize| shard.is_none_or(|(i, n)| t % n == i);
    on_base_market(&mut cfgs, &base);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = crate::run_dir::lock_folder(out)?;
    let params = |k: usize| -> BTreeMap<String, serde_json::Value> {
        points[k].iter().map(|(key, v)| (key.clone(), toml_to_json(v))).collect()
    };
    // Finished trials of an earlier start; a row that is not this sweep's is an error, not a
    // silent mix of two sweeps.
    let rows_path = out.join("trials.jsonl");
    let mut done: BTreeMap<usize, TrialRow> = BTreeMap::new();
    for r in read_rows(&rows_path)?.unwrap_or_default() {
        if let (Some((i, n)), true) = (shard, r.trial < cfgs.len() && !mine(r.trial)) {
            bail!(
                "{}: trial {} is not in shard {i}/{n} (another shard's folder?); use another --out",
                rows_path.display(),
                r.trial
            );
        }
        if r.trial >= cfgs.len() || r.params != params(r.trial) {
            bail!(
                "{}: trial {} is not one of this sweep's {} trials (another sweep file or --trials?); use another --out",
                rows_path.display(),
                r.trial,
                cfgs.len()
            );
        }
        done.insert(r.trial, r);
    }
    check_same_sweep(out, &spec)?;
    crate::run_dir::write_atomic(&out.join("sweep.toml"), toml::to_string(&spec)?.as_bytes())?;
    let selected: Vec<usize> = (0..cfgs.len()).filter(|&t| mine(t)).collect();
    if let Some((i, n)) = shard {
        println!("sweep shard {i}/{n}: {} of the {} trials", selected.len(), cfgs.len());
    }
    if let Some(h) = spec.halving.as_ref().filter(|_| base.model.is_sequence()) {
        let rows = if selected.iter().all(|t| done.contains_key(t)) {
            println!(
                "sweep {}: all {} trials done already; leaderboard from trials.jsonl",
                out.display(),
                selected.len()
            );
            done.into_values().collect()
        } else {
            let Some(rows) = halve(h, &cfgs, &selected, &params, out)? else {
                println!("sweep interrupted: the trials' folders keep their epochs; run the same command to go on");
                return Ok(Outcome::Interrupted);
            };
            write_rows(out, &rows)?;
            rows
        };
        let extra = json!({"populations": [], "shard": null,
            "halving": {"min_epochs": h.min_epochs.unwrap_or(1), "eta": h.eta, "rungs": h.rungs(base.seq.epochs)?}});
        return finish(&spec, &cfgs, &rows, out, spec.best, extra);
    }
    let refill = spec.halving.is_some() && !base.model.is_sequence();
    let waves = plan_waves(&base, &cfgs, &selected, spec.members, refill)?;
    let todo: Vec<&Wave> = waves.iter().filter(|w| w.trials.iter().any(|t| !done.contains_key(t))).collect();
    if !rows_path.exists() {
        // A shard with no trial of its own (more shards than trials) still leaves its rows,
        // none, for the merged report.
        write_rows(out, &done.values().cloned().collect::<Vec<_>>())?;
    }
    if todo.is_empty() {
        println!("sweep {}: all {} trials done already; leaderboard from trials.jsonl", out.display(), selected.len());
    } else if !done.is_empty() {
        println!("sweep {}: {} of {} trials done already; going on", out.display(), done.len(), selected.len());
    }
    let pop_path = out.join("population.json");
    let mut pop_doc: Vec<serde_json::Value> = match fx_data::files::read_regular_to_string(&pop_path, u64::MAX) {
        Ok(text) => serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|d| d["waves"].as_array().cloned())
            .unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    for wave in todo {
        let trials: Vec<usize> = wave.trials.iter().copied().filter(|t| !done.contains_key(t)).collect();
        let slots = wave.slots.min(trials.len());
        let dir = WaveDir { out, checkpoint_every: spec.checkpoint_every()? };
        let Some((rows, mut summary)) =
            train_population(&base, &cfgs, &trials, &params, &dir, plan.as_ref(), spec.halving.as_ref(), slots, stop)?
        else {
            println!(
                "sweep interrupted: {} of {} trials done (finished waves are kept); run the same command to go on",
                done.len(),
                selected.len()
            );
            return Ok(Outcome::Interrupted);
        };
        for r in rows {
            done.insert(r.trial, r);
        }
        let rows: Vec<TrialRow> = done.values().cloned().collect();
        write_rows(out, &rows)?;
        wave_state::remove(out, &trials)?;
        summary["trials"] = json!(trials);
        summary["members_source"] = json!(wave.source);
        pop_doc.push(summary);
        let doc = json!({"waves": pop_doc});
        crate::run_dir::write_atomic(&pop_path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    crate::population::remove_waves(out)?;
    let rows: Vec<TrialRow> = done.into_values().collect();
    let populations: Vec<usize> = waves.iter().map(|w| w.slots).collect();
    // A shard's best trials are its own; the sweep's come from the merged report.
    let best = if shard.is_some() { 0 } else { spec.best };
    let mut extra = json!({"populations": populations, "shard": shard.map(|(i, n)| format!("{i}/{n}"))});
    if let Some(h) = &spec.halving {
        // Each wave halves among its own trials (population.json has each wave's cuts).
        extra["halving"] = json!({"eta": h.eta, "rungs": h.step_rungs(base.steps)?, "within": "each wave"});
    }
    finish(&spec, &cfgs, &rows, out, best, extra)
}

/// A sweep with `sampler = "tpe"`: its rounds ([`TpeConfig::rounds`]) one after another,
/// round 0 on Sobol points and each later one proposed by [`tpe::suggest`] from every
/// earlier trial's validation Sharpe; each round trains as [`run_with`]'s trials do (waves,
/// rows written per wave). A restart recomputes the same points from the same rows, so it
/// goes on where it stopped. Not sharded (a round needs every earlier trial) and not with
/// `[pbt]` (both would choose the trials' settings).
fn run_tpe(
    spec: &SweepConfig,
    space: &[(String, Dim)],
    base: &RunConfig,
    config: &Path,
    out: &Path,
    sharded: bool,
    stop: &mut dyn FnMut() -> bool,
) -> Result<Outcome> {
    let file = config.display();
    let Some(total) = spec.trials.filter(|&n| n > 0) else {
        bail!("sweep file {file}: sampler = \"tpe\" needs trials = N (at least 1)")
    };
    if spec.pbt.is_some() {
        bail!("sweep file {file}: sampler = \"tpe\" and [pbt] both choose the trials' settings; use one of them");
    }
    if spec.halving.is_some() {
        bail!("sweep file {file}: sampler = \"tpe\" with [halving] is not supported yet (TPE ranks finished trials)");
    }
    if sharded {
        bail!("sweep file {file}: a TPE sweep proposes each round from every finished trial and is not sharded");
    }
    for (k, d) in space {
        d.validate(k)?;
    }
    let tcfg = spec.tpe.clone().unwrap_or_default();
    if tcfg.startup == 0 || tcfg.batch == Some(0) {
        bail!("sweep file {file}: [tpe] startup and batch must be at least 1");
    }
    if !(0.0..=1.0).contains(&tcfg.explore) {
        bail!("sweep file {file}: [tpe] explore = {} is not a share in [0, 1]", tcfg.explore);
    }
    let rounds = tcfg.rounds(total);
    let dims: Vec<Dim> = space.iter().map(|(_, d)| d.clone()).collect();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = crate::run_dir::lock_folder(out)?;
    let rows_path = out.join("trials.jsonl");
    let mut done: BTreeMap<usize, TrialRow> = BTreeMap::new();
    for r in read_rows(&rows_path)?.unwrap_or_default() {
        if r.trial >= total {
            bail!(
                "{}: trial {} is not one of this sweep's {total} trials (another sweep file or --trials?); use another --out",
                rows_path.display(),
                r.trial
            );
        }
        done.insert(r.trial, r);
    }
    check_same_sweep(out, spec)?;
    crate::run_dir::write_atomic(&out.join("sweep.toml"), toml::to_string(spec)?.as_bytes())?;
    if !rows_path.exists() {
        write_rows(out, &[])?;
    }
    let pop_path = out.join("population.json");
    let mut pop_doc: Vec<serde_json::Value> = match fx_data::files::read_regular_to_string(&pop_path, u64::MAX) {
        Ok(text) => serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|d| d["waves"].as_array().cloned())
            .unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let mut units = space::units(space, Sampler::Tpe, rounds[0].len(), spec.seed)?;
    let (mut points, mut cfgs): (Vec<space::Point>, Vec<RunConfig>) = (Vec::new(), Vec::new());
    let mut populations = Vec::new();
    for (r, range) in rounds.iter().enumerate() {
        if r > 0 {
            let history: Vec<tpe::Observed> = (0..range.start)
                .map(|t| tpe::Observed { u: units[t].clone(), objective: objective(&done[&t]) })
                .collect();
            units.extend(tpe::suggest(&dims, &history, range.len(), tcfg.explore, spec.seed, r as u64));
            println!(
                "sweep: TPE round {r}: trials {}..{} proposed from the {} before them",
                range.start, range.end, range.start
            );
        }
        for t in range.clone() {
            points.push(space::point_at(space, &units[t]));
            cfgs.push(point_config(spec, &points[t], t)?);
        }
        on_base_market(&mut cfgs[range.clone()], base);
        let params = |k: usize| -> BTreeMap<String, serde_json::Value> {
            points[k].iter().map(|(key, v)| (key.clone(), toml_to_json(v))).collect()
        };
        for t in range.clone() {
            if done.get(&t).is_some_and(|row| row.params != params(t)) {
                bail!(
                    "{}: trial {t} is not this sweep's (another sweep file or seed?); use another --out",
                    rows_path.display()
                );
            }
        }
        let trials: Vec<usize> = range.clone().collect();
        let waves = plan_waves(base, &cfgs, &trials, spec.members, false)?;
        populations.extend(waves.iter().map(|w| w.trials.len()));
        for wave in &waves {
            let todo: Vec<usize> = wave.trials.iter().copied().filter(|t| !done.contains_key(t)).collect();
            if todo.is_empty() {
                continue;
            }
            let dir = WaveDir { out, checkpoint_every: spec.checkpoint_every()? };
            let Some((rows, mut summary)) =
                train_population(base, &cfgs, &todo, &params, &dir, None, None, todo.len(), stop)?
            else {
                println!(
                    "sweep interrupted: {} of {total} trials done (finished waves are kept); run the same command to go on",
                    done.len()
                );
                return Ok(Outcome::Interrupted);
            };
            for row in rows {
                done.insert(row.trial, row);
            }
            write_rows(out, &done.values().cloned().collect::<Vec<_>>())?;
            wave_state::remove(out, &todo)?;
            summary["trials"] = json!(todo);
            summary["members_source"] = json!(wave.source);
            summary["tpe_round"] = json!(r);
            pop_doc.push(summary);
            let doc = json!({"waves": pop_doc});
            crate::run_dir::write_atomic(&pop_path, serde_json::to_string_pretty(&doc)?.as_bytes())?;
        }
    }
    crate::population::remove_waves(out)?;
    let rows: Vec<TrialRow> = done.into_values().collect();
    let extra = json!({
        "populations": populations,
        "shard": null,
        "tpe": {"startup": rounds[0].len(), "batch": tcfg.batch.unwrap_or(tcfg.startup), "rounds": rounds.len()},
    });
    finish(spec, &cfgs, &rows, out, spec.best, extra)
}

/// `tensorboard/trial-{k}/`: each trial's scalars for `tensorboard --logdir DIR`: a
/// forecaster's per-epoch `train/loss`, `val/loss` and `lr` (from its run's metrics), and
/// its validation sign strategy's `val/sharpe`; a DQN / PPO trial's `val/sharpe`,
/// `val/total_return` and `val/max_drawdown` at its env steps, with its PBT rounds'
/// `pbt/val_sharpe`. And for the HParams dashboard, the experiment in `tensorboard/` (the
/// space's keys; the metrics above, of which the dashboard shows each run's last value)
/// and each trial as a session of its values, a success when its row is `ok`. Rewritten
/// whenever the leaderboard is.
fn write_tensorboard(cfgs: &[RunConfig], rows: &[TrialRow], out: &Path) -> Result<()> {
    use crate::tensorboard::{HParam, Scalar, Session};
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    // The HParams dashboard: the space's keys as hyperparameters, the rows' values.
    let hparams = |r: &TrialRow| -> Vec<(String, HParam)> {
        r.params
            .iter()
            .map(|(k, v)| {
                let h = match v {
                    serde_json::Value::Number(n) => HParam::Number(n.as_f64().unwrap_or(f64::NAN)),
                    serde_json::Value::Bool(b) => HParam::Bool(*b),
                    serde_json::Value::String(t) => HParam::Text(t.clone()),
                    other => HParam::Text(other.to_string()),
                };
                (k.clone(), h)
            })
            .collect()
    };
    let tb = out.join("tensorboard");
    if let Some(first) = rows.first() {
        let metrics: &[&str] = if cfgs[first.trial].model.is_sequence() {
            &["val/loss", "val/sharpe"]
        } else {
            &["val/sharpe", "val/total_return", "val/max_drawdown"]
        };
        crate::tensorboard::write_experiment(&tb, &hparams(first), metrics, now)?;
    }
    for r in rows {
        let cfg = &cfgs[r.trial];
        let point = |tag: &str, step: i64, value: f64| Scalar { tag: tag.to_string(), step, value };
        let mut scalars = Vec::new();
        if cfg.model.is_sequence() {
            let metrics = out.join("trials").join(format!("trial-{}", r.trial)).join("metrics.jsonl");
            let text = fx_data::files::read_regular_to_string(&metrics, u64::MAX).unwrap_or_default();
            for line in text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
                let Some(epoch) = line["epoch"].as_i64() else { continue };
                for (tag, key) in [("train/loss", "train_loss"), ("val/loss", "val_loss"), ("lr", "lr")] {
                    if let Some(v) = line[key].as_f64() {
                        scalars.push(point(tag, epoch, v));
                    }
                }
            }
            scalars.push(point("val/sharpe", r.epochs.unwrap_or(0) as i64, r.val_sharpe));
        } else {
            let steps = i64::try_from(cfg.steps).unwrap_or(i64::MAX);
            for e in &r.pbt {
                scalars.push(point("pbt/val_sharpe", i64::try_from(e.env_step).unwrap_or(i64::MAX), e.val_sharpe));
            }
            scalars.push(point("val/sharpe", steps, r.val_sharpe));
            scalars.push(point("val/total_return", steps, r.val_total_return));
            scalars.push(point("val/max_drawdown", steps, r.val_max_drawdown));
        }
        let session = Session { hparams: hparams(r), success: r.status == "ok" };
        crate::tensorboard::write_scalars(&tb.join(format!("trial-{}", r.trial)), &scalars, Some(&session), now)?;
    }
    Ok(())
}

/// What makes two sweep files one sweep: everything but `trials` (more trials extend it),
/// `members` (how many trained at once changes no trial), `checkpoint_minutes` and
/// `run.device`.
fn sweep_identity(spec: &SweepConfig) -> Result<String> {
    let mut run = spec.run.clone();
    run.remove("device");
    Ok(toml::to_string(&SweepConfig { trials: None, members: None, checkpoint_minutes: None, run, ..spec.clone() })?)
}

/// Refuses to go on in `out` with another sweep than the one it was started with (an
/// edited file, another `--epochs` or `--steps`): its rows would be kept as this sweep's.
fn check_same_sweep(out: &Path, spec: &SweepConfig) -> Result<()> {
    let path = out.join("sweep.toml");
    if !path.exists() {
        return Ok(());
    }
    let text = fx_data::files::read_regular_to_string(&path, fx_data::files::MAX_TEXT_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    let saved: SweepConfig = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if sweep_identity(&saved)? != sweep_identity(spec)? {
        bail!(
            "{} was started with another sweep (its sweep.toml differs from this file with these flags: an edited file, --steps or --epochs?); use another --out",
            out.display()
        );
    }
    Ok(())
}

/// The leaderboard of `rows` (printed), the best `best` trials trained again as ordinary
/// runs in `out/best-{rank}`, and `sweep.json` with `extra`'s fields.
fn finish(
    spec: &SweepConfig,
    cfgs: &[RunConfig],
    rows: &[TrialRow],
    out: &Path,
    best_n: usize,
    extra: serde_json::Value,
) -> Result<Outcome> {
    let board = leaderboard(rows);
    print_board(&board, rows, out);
    write_tensorboard(cfgs, rows, out)?;
    // PBT's best are scored from their weights; the others are trained again as runs.
    let (mut best, runs) =
        if spec.pbt.is_some() { (pbt_best(cfgs, rows, &board, out, best_n)?, 0) } else { (Vec::new(), best_n) };
    for (rank, &i) in board.iter().take(runs).enumerate() {
        let trial = rows[i].trial;
        let mut cfg = cfgs[trial].clone();
        cfg.out = out.join(format!("best-{}", rank + 1));
        // Which trial a best-run folder holds: a later leaderboard (more shards merged) may
        // rank another trial there, which must not inherit this folder in silence.
        let marker = cfg.out.join("sweep-trial");
        if let Ok(held) = fx_data::files::read_regular_to_string(&marker, fx_data::files::MAX_TEXT_BYTES) {
            if held.trim() != trial.to_string() {
                bail!(
                    "{} holds trial {} but rank {} is now trial {trial}: move the best-run folders away or use another --out",
                    cfg.out.display(),
                    held.trim(),
                    rank + 1
                );
            }
        }
        let resume = cfg.out.join("config.toml").exists();
        if !(resume && cfg.out.join("report.json").exists()) {
            println!("training trial {trial} (rank {}) as an ordinary run in {}", rank + 1, cfg.out.display());
            let outcome = crate::lifecycle::run(
                cfg.clone(),
                crate::lifecycle::TrainOptions {
                    resume,
                    restart: false,
                    quiet: true,
                    steps: None,
                    pause_at: None,
                    inner: true,
                },
            )?;
            crate::run_dir::write_atomic(&marker, trial.to_string().as_bytes())?;
            if matches!(outcome, Outcome::Interrupted) {
                println!("interrupted while training the best trials; run the same sweep again to finish them");
                return Ok(Outcome::Interrupted);
            }
        }
        best.push(json!({"rank": rank + 1, "trial": trial, "run": cfg.out, "val_sharpe": rows[i].val_sharpe, "val_loss": rows[i].val_loss}));
    }
    let mut doc = json!({
        "trials_tried": rows.len(),
        "sampler": spec.sampler,
        "seed": spec.seed,
        "objective": if cfgs.first().is_some_and(|c| c.model.is_sequence()) {
            "val_loss (the best epoch's validation loss, lower is better; val_sharpe is the forecasts' sign strategy there)"
        } else {
            "val_sharpe (greedy policy, validation split)"
        },
        "test_split": if spec.pbt.is_some() {
            format!("scored only for the best {} trial(s)' final weights (PBT: in `best`)", best.len())
        } else {
            format!("scored only in the best {} run folder(s)", best.len())
        },
        "leaderboard": board.iter().map(|&i| json!({"trial": rows[i].trial, "val_sharpe": rows[i].val_sharpe, "val_loss": rows[i].val_loss, "params": rows[i].params})).collect::<Vec<_>>(),
        "best": best,
    });
    if let (Some(d), Some(x)) = (doc.as_object_mut(), extra.as_object()) {
        d.extend(x.clone());
    }
    crate::run_dir::write_atomic(&out.join("sweep.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    Ok(Outcome::Finished)
}

/// A PBT sweep's best trials: a member's weights come from its copies and schedule, which
/// an ordinary run does not replay, so the best `best_n` trials' final weights
/// (`weights/trial-{k}.safetensors`) are scored on the test split here, once.
fn pbt_best(
    cfgs: &[RunConfig],
    rows: &[TrialRow],
    board: &[usize],
    out: &Path,
    best_n: usize,
) -> Result<Vec<serde_json::Value>> {
    let mut best = Vec::new();
    let Some(&first) = board.first() else { return Ok(best) };
    let data = Dataset::load(&cfgs[rows[first].trial], None)?;
    for (rank, &i) in board.iter().take(best_n).enumerate() {
        let (trial, cfg) = (rows[i].trial, &cfgs[rows[i].trial]);
        let path = out.join("weights").join(format!("trial-{trial}.safetensors"));
        let context = || format!("PBT best trial {trial}");
        let mut policy = if cfg.model == ModelChoice::Ppo {
            let net = ActorCritic::new(cfg.ppo.net, &Device::Cpu, cfg.ppo.seed)?;
            net.params().load(&path).with_context(context)?;
            net.cpu_policy()?
        } else {
            let net = DuelingDqn::new(cfg.dqn.net, &Device::Cpu, cfg.dqn.seed)?;
            net.params().load(&path).with_context(context)?;
            net.cpu_policy()?
        };
        let s = &policy_stats(cfg, &data, &data.splits.test, &mut policy)?;
        println!(
            "PBT rank {}: trial {trial}: test Sharpe {:.3}, test return {:.4}",
            rank + 1,
            s.sharpe,
            s.total_return
        );
        best.push(json!({
            "rank": rank + 1,
            "trial": trial,
            "weights": path,
            "val_sharpe": rows[i].val_sharpe,
            "test_sharpe": if s.sharpe.is_finite() { json!(s.sharpe) } else { json!(null) },
            "test_total_return": s.total_return,
            "test_max_drawdown": s.max_drawdown,
            "pbt_copies": rows[i].pbt.len(),
        }));
    }
    Ok(best)
}

/// This process's shard `(i, n)`: `--shard I/N`, else a SLURM array's task (its id less the
/// array's first id, of its task count), else a Kubernetes Indexed Job's
/// `JOB_COMPLETION_INDEX` of the sweep file's `shards`; none: every trial. `env` reads the
/// environment (a parameter for tests).
fn shard_of(
    arg: Option<&str>,
    shards: Option<usize>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(usize, usize)>> {
    let num = |what: &str, v: &str| -> Result<usize> {
        v.trim().parse::<usize>().with_context(|| format!("{what} = {v:?} is not a whole number"))
    };
    let (i, n, what) = if let Some(a) = arg {
        let Some((i, n)) = a.split_once('/') else { bail!("--shard {a:?}: expected I/N, such as 0/4") };
        (num("--shard's I", i)?, num("--shard's N", n)?, "--shard")
    } else if let (Some(id), Some(count)) = (env("SLURM_ARRAY_TASK_ID"), env("SLURM_ARRAY_TASK_COUNT")) {
        let min = env("SLURM_ARRAY_TASK_MIN").map(|m| num("SLURM_ARRAY_TASK_MIN", &m)).transpose()?.unwrap_or(0);
        let id = num("SLURM_ARRAY_TASK_ID", &id)?;
        let i = id
            .checked_sub(min)
            .with_context(|| format!("SLURM_ARRAY_TASK_ID {id} is below SLURM_ARRAY_TASK_MIN {min}"))?;
        (i, num("SLURM_ARRAY_TASK_COUNT", &count)?, "the SLURM array")
    } else if let (Some(idx), Some(n)) = (env("JOB_COMPLETION_INDEX"), shards) {
        (num("JOB_COMPLETION_INDEX", &idx)?, n, "JOB_COMPLETION_INDEX and the sweep file's shards")
    } else {
        return Ok(None);
    };
    if n == 0 || i >= n {
        bail!("{what}: shard {i} of {n} (need 0 <= I < N)");
    }
    Ok(Some((i, n)))
}

/// `fx-train sweep --report DIR...`: the shard folders of one sweep (the same `sweep.toml`,
/// disjoint trials) merged into one leaderboard, printed; with `out`, the merged rows,
/// `sweep.json` and the best trials' run folders are written there.
fn report(dirs: &[PathBuf], out: Option<&Path>) -> Result<Outcome> {
    let read = |d: &PathBuf| -> Result<String> {
        let p = d.join("sweep.toml");
        fx_data::files::read_regular_to_string(&p, fx_data::files::MAX_TEXT_BYTES)
            .with_context(|| format!("reading {}", p.display()))
    };
    // The shards' sweep files must agree except in `members` (how many trials a shard's
    // device held at once changes no trial's result) and `run.device` (one shard a GPU).
    let spec_of = |d: &PathBuf| -> Result<(SweepConfig, String)> {
        let spec: SweepConfig =
            toml::from_str(&read(d)?).with_context(|| format!("parsing {}", d.join("sweep.toml").display()))?;
        let mut run = spec.run.clone();
        run.remove("device");
        let key = toml::to_string(&SweepConfig { members: None, run, ..spec.clone() })?;
        Ok((spec, key))
    };
    let (spec, text) = spec_of(&dirs[0])?;
    if spec.pbt.is_some() || spec.sampler == Sampler::Tpe {
        bail!("{}: a [pbt] or TPE sweep is not sharded, so there is nothing to merge", dirs[0].display());
    }
    let mut rows: BTreeMap<usize, TrialRow> = BTreeMap::new();
    for d in dirs {
        if spec_of(d)?.1 != text {
            bail!("{} is another sweep than {} (their sweep.toml differ)", d.display(), dirs[0].display());
        }
        let p = d.join("trials.jsonl");
        for r in read_rows(&p)?.with_context(|| format!("{} has no trials.jsonl (not started?)", d.display()))? {
            if rows.contains_key(&r.trial) {
                bail!("trial {} appears in two of the folders ({} among them)", r.trial, d.display());
            }
            rows.insert(r.trial, r);
        }
    }
    let space: Vec<(String, Dim)> = spec.space.clone().into_iter().collect();
    let points = space::sample(&space, spec.sampler, spec.trials, spec.seed)?;
    if rows.len() < points.len() {
        println!(
            "report: {} of the sweep's {} trials have rows (the other shards are not finished or not given)",
            rows.len(),
            points.len()
        );
    }
    let rows: Vec<TrialRow> = rows.into_values().collect();
    let Some(out) = out else {
        print_board(&leaderboard(&rows), &rows, &dirs[0]);
        return Ok(Outcome::Finished);
    };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let _lock = crate::run_dir::lock_folder(out)?;
    crate::run_dir::write_atomic(&out.join("sweep.toml"), text.as_bytes())?;
    write_rows(out, &rows)?;
    let mut cfgs = trial_configs(&spec, &points)?;
    let base = RunConfig::from_toml_str(&toml::to_string(&spec.run)?, "the sweep's [run]")?.resolve()?;
    on_base_market(&mut cfgs, &base);
    let merged: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    finish(&spec, &cfgs, &rows, out, spec.best, json!({"merged_from": merged}))
}

/// A forecaster wave's `source`: its trials train one after another.
const SEQUENTIAL: &str = "sequential (forecaster trials train one after another)";

/// Trials trained together as one population (a forecaster's: one trial).
#[derive(Debug, Clone, PartialEq)]
struct Wave {
    trials: Vec<usize>,
    /// Members trained at once: all of `trials`, or fewer when a freed slot takes the next
    /// trial (DQN and PPO with `[halving]`).
    slots: usize,
    /// Where the population size came from (`config`, `env FX_POPULATION`, `derived`).
    source: String,
}

/// Trials grouped by shape (one population per [`DqnPopulation::shape_key`], in the order of
/// their first trial), each group cut into waves as large as the device holds
/// (`fx_hw::HardwareBudget::population_size`, or `members` / `FX_POPULATION`); with `refill`
/// (DQN and PPO under `[halving]`) each group is one wave of that many slots, a freed slot taking the
/// group's next trial.
fn plan_waves(
    base: &RunConfig,
    cfgs: &[RunConfig],
    selected: &[usize],
    members: Option<usize>,
    refill: bool,
) -> Result<Vec<Wave>> {
    if base.model.is_sequence() {
        println!("sweep: {} {} trial(s), one after another (see the module docs)", selected.len(), base.model.as_str());
        return Ok(selected
            .iter()
            .map(|&t| Wave { trials: vec![t], slots: 1, source: SEQUENTIAL.to_string() })
            .collect());
    }
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for &i in selected {
        let c = &cfgs[i];
        let key = match base.model {
            ModelChoice::Ppo => format!("{} x {} accounts", PpoPopulation::shape_key(&c.ppo), c.env.num_envs),
            _ => DqnPopulation::shape_key(&c.dqn),
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    let mut waves = Vec::new();
    for (_, g) in &groups {
        let c = &cfgs[g[0]];
        // The trials' device is the base config's.
        let size =
            crate::population::wave_size(&RunConfig { device: base.device.clone(), ..c.clone() }, members, g.len())?;
        println!(
            "sweep: {} trial(s) of one shape in waves of at most {} member(s) ({})",
            g.len(),
            size.value,
            size.source
        );
        if refill {
            waves.push(Wave { trials: g.clone(), slots: size.value.min(g.len()), source: size.source.to_string() });
            continue;
        }
        for chunk in g.chunks(size.value) {
            waves.push(Wave { trials: chunk.to_vec(), slots: chunk.len(), source: size.source.to_string() });
        }
    }
    Ok(waves)
}

/// What a DQN or PPO wave's PBT needs: the `[pbt]` section, the sweep (a moved member's run config
/// is made from its new point as a trial's is), the space, the perturbed dimensions and every
/// trial's starting point.
struct PbtPlan<'a> {
    cfg: &'a PbtConfig,
    spec: &'a SweepConfig,
    space: &'a [(String, Dim)],
    keys: Vec<usize>,
    points: &'a [space::Point],
}

/// Where a DQN / PPO wave writes (the sweep's folder) and how often it checkpoints while
/// it trains (none: only when stopped; see [`wave_state`]).
struct WaveDir<'a> {
    out: &'a Path,
    checkpoint_every: Option<std::time::Duration>,
}

impl WaveDir<'_> {
    /// The checkpoint of the wave of `trials` (see [`wave_state`]).
    fn checkpoint(&self, trials: &[usize]) -> crate::population::WaveCheckpoint {
        let path = wave_state::path(self.out, trials);
        crate::population::WaveCheckpoint::new(path, self.checkpoint_every, format!("sweep: trials {trials:?}"))
    }
}

/// Trains `trials` as one population on the base config's training split (with `pbt`, its
/// rounds every `pbt.every` env steps; with `halving`, its rungs), then scores each
/// member's greedy policy on the validation split. `None` when `stop` asked to stop.
#[allow(clippy::too_many_arguments)]
fn train_population(
    base: &RunConfig,
    cfgs: &[RunConfig],
    trials: &[usize],
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    dir: &WaveDir<'_>,
    pbt: Option<&PbtPlan<'_>>,
    halving: Option<&HalvingConfig>,
    slots: usize,
    stop: &mut dyn FnMut() -> bool,
) -> Result<Option<(Vec<TrialRow>, serde_json::Value)>> {
    if base.model == ModelChoice::Ppo {
        return train_ppo_population(base, cfgs, trials, params, dir, pbt, halving, slots, stop);
    }
    if base.model.is_sequence() {
        return train_seq_trials(cfgs, trials, params, dir.out);
    }
    let out = dir.out;
    let (device, data, rows) = population_inputs(base)?;
    let make_envs = |ts: &[usize]| trial_envs(&rows, cfgs, ts, &device);
    let mut ck = dir.checkpoint(trials);
    let first = slots.clamp(1, trials.len());
    let fresh = || {
        let members: Vec<DqnConfig> = trials[..first].iter().map(|&t| cfgs[t].dqn.clone()).collect();
        DqnPopulation::new(members, &device).context("building the sweep's population")
    };
    let load = |p: &Path| DqnPopulation::load_state(p, &device);
    let (mut pop, mut envs, mut w) =
        wave_state::open(&ck, trials, slots, base, params, pbt, halving, &make_envs, load, fresh)?;
    let n = pop.len();
    println!(
        "sweep: trials {:?} as one population of {n} on {}, {} env steps x {} accounts each{}",
        trials,
        if device.is_cuda() { "cuda" } else { "cpu" },
        base.steps,
        envs[0].num_envs(),
        if trials.len() > n {
            format!(" (a freed slot takes the next of the {} trials)", trials.len())
        } else {
            String::new()
        }
    );
    let mut busy = crate::gpu_busy::GpuBusy::for_device(&device);
    let t0 = Instant::now();
    let prior_s = w.train_seconds;
    // With halving, members keep their own clocks (a freed slot's new trial starts at 0), so
    // the population trains until its last member is done; otherwise to the run's steps.
    let mut step = w.env_steps;
    loop {
        if w.halving.as_ref().map_or(step >= base.steps, |h| h.alive.is_empty()) {
            break;
        }
        step += 1;
        w.train_seconds = prior_s + t0.elapsed().as_secs_f64();
        if ck.before_step(stop(), w.env_steps, &device, || pop.snapshot(), &envs, &w)? {
            return Ok(None);
        }
        let read = step % base.log_every == 0 || step == base.steps;
        let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e.as_vec_env()).collect();
        let st = pop.step(&mut refs, read)?;
        // Members not learning yet (new in a freed slot) take no step in a round.
        let members = pop.learning_members() as u64;
        w.samples += (st.updates.len() as u64 + u64::from(st.updates_queued)) * members * base.dqn.batch_size as u64;
        if read {
            let r = st.mean_reward.as_deref().unwrap_or_default();
            let mean = r.iter().sum::<f64>() / r.len().max(1) as f64;
            println!("sweep: env step {step}/{}: mean reward over trials {mean:.3e}", base.steps);
        }
        if let Some(h) = w.halving.as_mut() {
            if !h.after_step(base, &data, &mut pop, &mut envs, params, out, step, cfgs, &make_envs)? {
                w.env_steps = step;
                break;
            }
        }
        // No round after the last step: the final scoring ranks what the last round made.
        if let Some(plan) = pbt.filter(|p| step % p.cfg.every == 0 && step < base.steps) {
            let t = Instant::now();
            pbt_round(plan, base, &data, &mut pop, trials, &mut w.points, &mut w.events, step)?;
            w.pbt_seconds += t.elapsed().as_secs_f64();
            w.rounds += 1;
        }
        w.env_steps = step;
    }
    device.synchronize()?;
    let train_s = prior_s + t0.elapsed().as_secs_f64();
    // Under halving every member may be done already (scored as it finished or stopped):
    // then no member is left to score here.
    #[allow(unused_mut)] // written under `cuda`
    let mut summary =
        wave_summary(slots.min(trials.len()), trials.len(), &device, w.env_steps, train_s, w.samples, &mut busy);
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        // Which collection path trained (the population's steps as whole-iteration graphs are
        // opt-in: FX_POP_ITERATION_GRAPH=1).
        let steps = pop.iteration_graph_steps();
        println!("sweep: {steps} population steps replayed as whole-iteration graphs (FX_POP_ITERATION_GRAPH=1 turns them on)");
        summary["iteration_graph_steps"] = json!(steps);
    }
    let (applied, skipped) = pop.counters()?;
    let member = |k: usize| Ok((pop.online().member(k)?, dqn_member_policy(&pop, k)?));
    end_wave(base, &data, w, params, out, &applied, &skipped, &member, pbt.is_some(), summary).map(Some)
}

/// A wave's rows and summary once it has trained: each member's greedy policy scored on
/// the validation split ([`score_members`]), its PBT copies, successive halving's stopped
/// rows and cuts, PBT's rounds and time.
#[allow(clippy::too_many_arguments)]
fn end_wave(
    base: &RunConfig,
    data: &Dataset,
    w: WaveProgress,
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    out: &Path,
    applied: &[u64],
    skipped: &[u64],
    member: &Member<'_>,
    pbt: bool,
    mut summary: serde_json::Value,
) -> Result<(Vec<TrialRow>, serde_json::Value)> {
    let mut rows = score_members(base, data, w.alive(), params, out, applied, skipped, member)?;
    for (row, ev) in rows.iter_mut().zip(w.events) {
        row.pbt = ev;
    }
    if let Some(h) = w.halving {
        rows = h.finish(rows, &mut summary);
    }
    if pbt {
        // The rounds' scoring (validation backtests on the CPU) is inside train_seconds
        // (and counts as idle time in the GPU busy fraction).
        summary["pbt_rounds"] = json!(w.rounds);
        summary["pbt_seconds"] = json!(w.pbt_seconds);
    }
    Ok((rows, summary))
}

/// Forecaster trials (TFT, MAMBA-2), one after another: each an ordinary run in
/// `out/trials/trial-{k}` that reports on the validation split only
/// (`RunConfig::validation_only`), resumed from its checkpoint when a stopped sweep starts
/// again. The row's objective is the best epoch's validation loss; its `val_*` backtest
/// fields are the forecasts' sign strategy on the validation split. `None` when a signal
/// stopped a trial.
fn train_seq_trials(
    cfgs: &[RunConfig],
    trials: &[usize],
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    out: &Path,
) -> Result<Option<(Vec<TrialRow>, serde_json::Value)>> {
    let mut rows = Vec::with_capacity(trials.len());
    let t0 = Instant::now();
    for &t in trials {
        let cfg = seq_trial_config(cfgs, t, out);
        if train_seq_trial(&cfg, t, None)? == TrialRun::Stopped {
            return Ok(None);
        }
        rows.push(seq_trial_row(&cfg.out, t, params)?);
    }
    let train_s = t0.elapsed().as_secs_f64();
    let summary = json!({
        "members": 1,
        "device": cfgs[trials[0]].device,
        "train_seconds": train_s,
        "runs": trials.iter().map(|&t| seq_trial_config(cfgs, t, out).out).collect::<Vec<_>>(),
    });
    Ok(Some((rows, summary)))
}

/// Forecaster trial `t`'s run config: its folder `out/trials/trial-{t}`, validation only.
fn seq_trial_config(cfgs: &[RunConfig], t: usize, out: &Path) -> RunConfig {
    let mut cfg = cfgs[t].clone();
    cfg.out = out.join("trials").join(format!("trial-{t}"));
    cfg.validation_only = true;
    cfg
}

/// How a forecaster trial's training call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrialRun {
    /// Finished, or paused at the epoch asked for.
    Ran,
    /// A non-finite loss or gradient stopped it (the CPU step refuses them; a captured
    /// GPU step skips them instead): recorded in its folder, not trained again.
    Diverged,
    /// A signal stopped it.
    Stopped,
}

/// Marks a forecaster trial's folder: the config the sweep started it with (its `out`
/// left out, so a moved sweep folder still matches), and why it diverged.
const TRIAL_CONFIG: &str = "sweep-trial.toml";
const TRIAL_DIVERGED: &str = "sweep-diverged.txt";

/// Trains (or resumes) a forecaster trial's run, to its end or paused after `pause_at`
/// epochs; nothing when it has finished or diverged. A folder started with another config
/// (an edited sweep file, another `--epochs`) is refused rather than resumed under it.
fn train_seq_trial(cfg: &RunConfig, t: usize, pause_at: Option<usize>) -> Result<TrialRun> {
    let dir = &cfg.out;
    let marker = dir.join(TRIAL_CONFIG);
    let want = RunConfig { out: PathBuf::new(), ..cfg.clone() }.to_toml()?;
    let started = dir.join("config.toml").exists();
    if started {
        let held = fx_data::files::read_regular_to_string(&marker, fx_data::files::MAX_TEXT_BYTES).ok();
        if held.as_deref() != Some(want.as_str()) {
            bail!(
                "{}: trial {t}'s folder was started with another config than this sweep's (an edited sweep file or --epochs?); use another --out",
                dir.display()
            );
        }
    }
    if dir.join(TRIAL_DIVERGED).exists() {
        return Ok(TrialRun::Diverged);
    }
    if started && dir.join("report.json").exists() {
        return Ok(TrialRun::Ran);
    }
    if !started {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        crate::run_dir::write_atomic(&marker, want.as_bytes())?;
    }
    println!(
        "sweep: trial {t} as a {} run in {}{}{}",
        cfg.model.as_str(),
        dir.display(),
        pause_at.map(|e| format!(" to epoch {e}")).unwrap_or_default(),
        if started { " (resumed)" } else { "" }
    );
    let opts = crate::lifecycle::TrainOptions {
        resume: started,
        restart: false,
        quiet: true,
        steps: None,
        pause_at: pause_at.map(|e| e as u64),
        inner: true,
    };
    match crate::lifecycle::run(cfg.clone(), opts) {
        Ok(Outcome::Interrupted) => Ok(TrialRun::Stopped),
        Ok(_) => Ok(TrialRun::Ran),
        Err(e) if is_non_finite(&e) => {
            println!("sweep: trial {t} diverged: {e:#}");
            crate::run_dir::write_atomic(&dir.join(TRIAL_DIVERGED), format!("{e:#}\n").as_bytes())?;
            Ok(TrialRun::Diverged)
        }
        Err(e) => Err(e.context(format!("sweep trial {t}"))),
    }
}

/// Whether a trial's error is its training producing a non-finite loss or gradient.
fn is_non_finite(e: &anyhow::Error) -> bool {
    e.chain().any(|c| matches!(c.downcast_ref::<fx_models::Error>(), Some(fx_models::Error::NonFinite { .. })))
}

/// A finished forecaster trial's row, from its validation report (a diverged one's: from
/// its metrics so far).
fn seq_trial_row(
    dir: &Path,
    t: usize,
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
) -> Result<TrialRow> {
    if dir.join(TRIAL_DIVERGED).exists() {
        let (epochs, _, steps, skipped) = seq_trial_at(dir, usize::MAX).unwrap_or((0, f64::NAN, 0, 0));
        return Ok(unfinished_row(t, params(t), (epochs, f64::NAN, steps, skipped)));
    }
    let report = dir.join("report.json");
    let rep = read_json(&report)?;
    if rep["split"] != "validation" {
        bail!("{}: a sweep trial's report must be of the validation split", report.display());
    }
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let stats = &rep["agent"]["stats"];
    let loss = num(&rep["best_val_loss"]);
    let steps = rep["steps"].as_u64().unwrap_or(0);
    let skipped = rep["skipped_steps"].as_u64().unwrap_or(0);
    Ok(TrialRow {
        trial: t,
        params: params(t),
        val_sharpe: num(&stats["sharpe"]),
        val_total_return: num(&stats["total_return"]),
        val_max_drawdown: num(&stats["max_drawdown"]),
        updates: steps - skipped.min(steps),
        skipped_updates: skipped,
        status: if loss.is_finite() && steps > skipped { "ok" } else { "diverged" }.into(),
        pbt: Vec::new(),
        val_loss: loss.is_finite().then_some(loss),
        epochs: rep["epochs_done"].as_u64().map(|e| e as usize),
        env_steps: None,
        rungs: Vec::new(),
    })
}

/// The row of a forecaster trial that did not finish: stopped by successive halving at
/// `(epochs, best loss so far, steps, skipped)`, or diverged (a non-finite loss).
fn unfinished_row(t: usize, params: BTreeMap<String, serde_json::Value>, at: (usize, f64, u64, u64)) -> TrialRow {
    let (epochs, loss, steps, skipped) = at;
    TrialRow {
        trial: t,
        params,
        val_sharpe: f64::NAN,
        val_total_return: f64::NAN,
        val_max_drawdown: f64::NAN,
        updates: steps - skipped.min(steps),
        skipped_updates: skipped,
        status: if loss.is_finite() { "stopped" } else { "diverged" }.into(),
        pbt: Vec::new(),
        val_loss: loss.is_finite().then_some(loss),
        epochs: Some(epochs),
        env_steps: None,
        rungs: Vec::new(),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = fx_data::files::read_regular_to_string(path, fx_data::files::MAX_TEXT_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// A forecaster trial's line of `metrics.jsonl` at `epoch` (its last when it stopped
/// earlier): (epochs done, best validation loss so far, optimiser steps, skipped steps).
fn seq_trial_at(dir: &Path, epoch: usize) -> Result<(usize, f64, u64, u64)> {
    let path = dir.join("metrics.jsonl");
    let text = fx_data::files::read_regular_to_string(&path, u64::MAX)
        .with_context(|| format!("reading {}", path.display()))?;
    let mut at = None;
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), i + 1))?;
        let e = v["epoch"].as_u64().with_context(|| format!("{}: line {}: no epoch", path.display(), i + 1))? as usize;
        if e <= epoch {
            let loss = v["best_val_loss"].as_f64().unwrap_or(f64::NAN);
            at = Some((e, loss, v["steps"].as_u64().unwrap_or(0), v["skipped_steps"].as_u64().unwrap_or(0)));
        }
    }
    at.with_context(|| format!("{}: no epoch trained", path.display()))
}

/// Successive halving of forecaster `trials` ([`halving`]): each rung trains the trials
/// still in to its epochs (pausing them there), then keeps the best share by their best
/// validation loss so far; the last rung's trials train to the end and are scored as
/// [`train_seq_trials`]'s are, the others' rows say where they stopped. Every trial must
/// share `seq.epochs` (the rungs). `None` when a signal stopped a trial.
fn halve(
    h: &HalvingConfig,
    cfgs: &[RunConfig],
    trials: &[usize],
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    out: &Path,
) -> Result<Option<Vec<TrialRow>>> {
    let epochs = cfgs[trials[0]].seq.epochs;
    if let Some(&t) = trials.iter().find(|&&t| cfgs[t].seq.epochs != epochs) {
        bail!(
            "[halving]: trial {t} has seq.epochs = {}, trial {} {epochs}; the rungs need one length",
            cfgs[t].seq.epochs,
            trials[0]
        );
    }
    let rungs = h.rungs(epochs)?;
    let mut alive = trials.to_vec();
    let mut stopped: BTreeMap<usize, (usize, f64, u64, u64)> = BTreeMap::new();
    for (k, &r) in rungs.iter().enumerate() {
        let last = k + 1 == rungs.len();
        let mut losses = Vec::with_capacity(alive.len());
        for &t in &alive {
            let cfg = seq_trial_config(cfgs, t, out);
            let at = match train_seq_trial(&cfg, t, (!last).then_some(r))? {
                TrialRun::Stopped => return Ok(None),
                // Last at every later rung (its loss is no number); its row says why.
                TrialRun::Diverged => (0, f64::NAN, 0, 0),
                TrialRun::Ran => seq_trial_at(&cfg.out, r)?,
            };
            losses.push(at.1);
            stopped.insert(t, at);
        }
        if !last {
            let kept = halving::keep(&alive, &losses, h.eta);
            println!(
                "sweep: halving at epoch {r}: {} of {} trials go on to epoch {} ({:?})",
                kept.len(),
                alive.len(),
                rungs[k + 1],
                kept
            );
            alive = kept;
        }
    }
    let mut rows = Vec::with_capacity(trials.len());
    for &t in trials {
        let dir = seq_trial_config(cfgs, t, out).out;
        if alive.contains(&t) || dir.join(TRIAL_DIVERGED).exists() {
            rows.push(seq_trial_row(&dir, t, params)?);
            continue;
        }
        rows.push(unfinished_row(t, params(t), stopped[&t]));
    }
    Ok(Some(rows))
}

/// One PBT round at env step `step`: every member scored on the validation split, the
/// bottom members moved onto copies of top ones with perturbed settings
/// ([`pbt::exploits`], [`pbt::explore`]); `points` and `events` follow the members.
#[allow(clippy::too_many_arguments)]
fn pbt_round(
    plan: &PbtPlan<'_>,
    base: &RunConfig,
    data: &Dataset,
    pop: &mut dyn PopMembers,
    trials: &[usize],
    points: &mut [space::Point],
    events: &mut [Vec<PbtEvent>],
    step: u64,
) -> Result<()> {
    let round = step / plan.cfg.every;
    let policies = (0..trials.len()).map(|k| pop.policy(k)).collect::<Result<Vec<_>>>()?;
    let scores: Vec<f64> =
        score_policies(base, data, &data.splits.valid, policies)?.into_iter().map(|s| s.sharpe).collect();
    let moves = pbt::exploits(&scores, plan.cfg.quantile, plan.spec.seed, round);
    for m in &moves {
        let (dst, src) = (trials[m.dst], trials[m.src]);
        let point = pbt::explore(
            &points[m.dst],
            &points[m.src],
            plan.space,
            &plan.keys,
            &plan.cfg.factors,
            plan.spec.seed,
            round,
            dst,
        );
        let mut cfg = point_config(plan.spec, &point, dst)?;
        on_base_market(std::slice::from_mut(&mut cfg), base);
        pop.exploit(m.dst, m.src).with_context(|| format!("PBT round {round}: trial {dst} copying trial {src}"))?;
        pop.set(m.dst, &cfg).with_context(|| format!("PBT round {round}: trial {dst}'s new settings"))?;
        let params = plan.keys.iter().map(|&d| (point[d].0.clone(), toml_to_json(&point[d].1))).collect();
        events[m.dst].push(PbtEvent { round, env_step: step, copied_from: src, val_sharpe: scores[m.dst], params });
        points[m.dst] = point;
    }
    let moved: Vec<String> = moves.iter().map(|m| format!("{}<-{}", trials[m.dst], trials[m.src])).collect();
    println!("sweep: PBT round {round} at env step {step}: trials {}", moved.join(" "));
    Ok(())
}

/// What PBT rounds and halving rungs do to a population's members (DQN or PPO).
trait PopMembers {
    /// Number of members.
    fn len(&self) -> usize;
    /// Member `k`'s greedy policy on the CPU (what a round or a rung scores).
    fn policy(&self, k: usize) -> Result<fx_models::mlp::cpu::CpuPolicy>;
    /// Member `k`'s network under the spec's names (its `weights/trial-{t}` file).
    fn weights(&self, k: usize) -> Result<fx_models::ParamStore>;
    /// Per member: optimiser steps applied and skipped.
    fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)>;
    /// Member `dst` continues from member `src`'s weights and optimiser state.
    fn exploit(&mut self, dst: usize, src: usize) -> Result<()>;
    /// Member `k` takes the settings of run config `cfg`.
    fn set(&mut self, k: usize, cfg: &RunConfig) -> Result<()>;
    /// Only the members `keep` go on.
    fn retain(&mut self, keep: &[usize]) -> Result<()>;
    /// Member `k` starts over as a new run of `cfg` (a freed slot's next trial).
    fn replace(&mut self, k: usize, cfg: &RunConfig) -> Result<()>;
    /// Env steps member `k` has taken since it began.
    fn member_env_steps(&self, k: usize) -> Result<u64>;
}

impl PopMembers for DqnPopulation {
    fn len(&self) -> usize {
        DqnPopulation::len(self)
    }
    fn policy(&self, k: usize) -> Result<fx_models::mlp::cpu::CpuPolicy> {
        dqn_member_policy(self, k)
    }
    fn weights(&self, k: usize) -> Result<fx_models::ParamStore> {
        Ok(self.online().member(k)?)
    }
    fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        Ok(DqnPopulation::counters(self)?)
    }
    fn exploit(&mut self, dst: usize, src: usize) -> Result<()> {
        Ok(DqnPopulation::exploit(self, dst, src)?)
    }
    fn set(&mut self, k: usize, cfg: &RunConfig) -> Result<()> {
        Ok(self.set_member(k, cfg.dqn.clone())?)
    }
    fn retain(&mut self, keep: &[usize]) -> Result<()> {
        Ok(self.retain_members(keep)?)
    }
    fn replace(&mut self, k: usize, cfg: &RunConfig) -> Result<()> {
        Ok(self.replace_member(k, cfg.dqn.clone())?)
    }
    fn member_env_steps(&self, k: usize) -> Result<u64> {
        DqnPopulation::member_env_steps(self, k).with_context(|| format!("no member {k}"))
    }
}

impl PopMembers for PpoPopulation {
    fn len(&self) -> usize {
        PpoPopulation::len(self)
    }
    fn policy(&self, k: usize) -> Result<fx_models::mlp::cpu::CpuPolicy> {
        ppo_member_policy(self, k)
    }
    fn weights(&self, k: usize) -> Result<fx_models::ParamStore> {
        Ok(self.params().member(k)?)
    }
    fn counters(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        Ok(PpoPopulation::counters(self)?)
    }
    fn exploit(&mut self, dst: usize, src: usize) -> Result<()> {
        Ok(PpoPopulation::exploit(self, dst, src)?)
    }
    fn set(&mut self, k: usize, cfg: &RunConfig) -> Result<()> {
        Ok(self.set_member(k, cfg.ppo.clone())?)
    }
    fn retain(&mut self, keep: &[usize]) -> Result<()> {
        Ok(self.retain_members(keep)?)
    }
    fn replace(&mut self, k: usize, cfg: &RunConfig) -> Result<()> {
        Ok(self.replace_member(k, cfg.ppo.clone())?)
    }
    fn member_env_steps(&self, k: usize) -> Result<u64> {
        PpoPopulation::member_env_steps(self, k).with_context(|| format!("no member {k}"))
    }
}

/// Successive halving of one DQN / PPO population ([`halving`]), asynchronous (ASHA's rule):
/// each member meets the rungs at its own env steps; the members that reach a rung together
/// are ranked with every trial that reached it before, and those among the best `1/eta` of
/// all of them go on, the others stop. A slot freed by a stopped or finished member takes the
/// next waiting trial at step 0 (`queue`), so the population stays full while trials wait;
/// a freed slot with none left is dropped. Members that all start together (no queue) meet
/// each rung together, which is the synchronous rule. Deterministic: the
/// arrivals at a step are ranked in trial order, so a restarted sweep decides the same.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PopHalving {
    eta: usize,
    /// The rungs before the end, in env steps of a member's own clock.
    rungs: Vec<u64>,
    /// The next rung of all members in a state written before members had their own clocks
    /// (read by [`Self::upgrade`] only).
    #[serde(default, skip_serializing)]
    next: usize,
    /// The next rung of every member.
    #[serde(default)]
    next_rung: Vec<usize>,
    /// Member `k`'s trial.
    alive: Vec<usize>,
    /// Trials waiting for a slot, in order.
    #[serde(default)]
    queue: Vec<usize>,
    /// Per rung, every trial that reached it so far and its validation Sharpe there.
    #[serde(default)]
    reached: Vec<Vec<Reached>>,
    stopped: Vec<TrialRow>,
    /// Trials that trained to the end while other members went on.
    #[serde(default)]
    finished: Vec<TrialRow>,
    scores: BTreeMap<usize, Vec<RungScore>>,
    log: Vec<serde_json::Value>,
}

/// A trial's score at a rung (a NaN Sharpe is written as null, as in the rows).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Reached {
    trial: usize,
    #[serde(with = "nan_as_null")]
    val_sharpe: f64,
}

impl PopHalving {
    /// Halving of `trials`, the first `slots` of which train first (the others wait).
    fn new(h: &HalvingConfig, steps: u64, trials: &[usize], slots: usize) -> Result<Self> {
        let mut rungs = h.step_rungs(steps)?;
        rungs.pop();
        let slots = slots.clamp(1, trials.len().max(1));
        Ok(Self {
            eta: h.eta,
            reached: vec![Vec::new(); rungs.len()],
            rungs,
            next: 0,
            next_rung: vec![0; slots.min(trials.len())],
            alive: trials[..slots.min(trials.len())].to_vec(),
            queue: trials[slots.min(trials.len())..].to_vec(),
            stopped: Vec::new(),
            finished: Vec::new(),
            scores: BTreeMap::new(),
            log: Vec::new(),
        })
    }

    /// A state read from a checkpoint of an older layout: one next rung for every member.
    fn upgrade(&mut self) {
        if self.next_rung.len() != self.alive.len() {
            self.next_rung = vec![self.next; self.alive.len()];
        }
        self.reached.resize(self.rungs.len(), Vec::new());
    }

    /// The members due at a rung, by rung (lowest first): member `k` at its own env step
    /// `local[k]` is due at its next rung once it is at or past it.
    fn arrivals(&self, local: &[u64]) -> Vec<(usize, Vec<usize>)> {
        let mut by: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (k, (&r, &at)) in self.next_rung.iter().zip(local).enumerate() {
            if self.rungs.get(r).is_some_and(|&step| at >= step) {
                by.entry(r).or_default().push(k);
            }
        }
        by.into_iter().collect()
    }

    /// Of the trials `arrived` at rung `r` with their Sharpes there, those that go on: the
    /// ones among the best `ceil(n / eta)` of all `n` trials that reached `r` so far
    /// ([`halving::keep`]); the arrivals join the rung's record.
    fn decide(&mut self, r: usize, arrived: &[(usize, f64)]) -> Vec<usize> {
        self.reached[r].extend(arrived.iter().map(|&(trial, val_sharpe)| Reached { trial, val_sharpe }));
        let trials: Vec<usize> = self.reached[r].iter().map(|x| x.trial).collect();
        let neg: Vec<f64> = self.reached[r].iter().map(|x| -x.val_sharpe).collect();
        let best = halving::keep(&trials, &neg, self.eta);
        arrived.iter().map(|&(t, _)| t).filter(|t| best.contains(t)).collect()
    }

    /// The rungs due at the population's env step `env_step` (member `k` at its own step
    /// `local[k]`): each due member's greedy policy scored on the validation split, the
    /// decision ([`Self::decide`]), the stopped members' rows made (`stopped`, their weights
    /// saved as a finished trial's are). Returns the stopped members' slots (ascending);
    /// the caller refills or drops them ([`Self::refill`], [`Self::drop_slots`]).
    #[allow(clippy::too_many_arguments)]
    fn rung(
        &mut self,
        base: &RunConfig,
        data: &Dataset,
        pop: &dyn PopMembers,
        params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
        out: &Path,
        env_step: u64,
        local: &[u64],
    ) -> Result<Vec<usize>> {
        let mut freed = Vec::new();
        for (r, slots) in self.arrivals(local) {
            let rung_step = self.rungs[r];
            let policies = slots.iter().map(|&k| pop.policy(k)).collect::<Result<Vec<_>>>()?;
            let stats = score_policies(base, data, &data.splits.valid, policies)?;
            let arrived: Vec<(usize, f64)> =
                slots.iter().zip(&stats).map(|(&k, s)| (self.alive[k], s.sharpe)).collect();
            // A member's own step where it was scored (PPO: the iteration boundary at or past
            // the rung).
            for (&k, &(t, sharpe)) in slots.iter().zip(&arrived) {
                self.scores.entry(t).or_default().push(RungScore { env_step: local[k], val_sharpe: sharpe });
            }
            let kept = self.decide(r, &arrived);
            let (applied, skipped) = pop.counters()?;
            let weights = out.join("weights");
            std::fs::create_dir_all(&weights).with_context(|| format!("creating {}", weights.display()))?;
            let mut stopped = Vec::new();
            for (&k, s) in slots.iter().zip(&stats) {
                let t = self.alive[k];
                if kept.contains(&t) {
                    self.next_rung[k] += 1;
                    continue;
                }
                pop.weights(k)?.save(&weights.join(format!("trial-{t}.safetensors")))?;
                let mut row = member_row(t, params(t), s, applied[k], skipped[k]);
                if row.status == "ok" {
                    row.status = "stopped".into();
                }
                row.env_steps = Some(local[k]);
                self.stopped.push(row);
                stopped.push(t);
                freed.push(k);
            }
            println!(
                "sweep: halving at env step {rung_step} (population step {env_step}): {} of {} trials go on ({kept:?}); {} reached it so far",
                kept.len(),
                slots.len(),
                self.reached[r].len()
            );
            self.log.push(json!({"env_step": rung_step, "at": env_step, "kept": kept, "stopped": stopped}));
        }
        freed.sort_unstable();
        Ok(freed)
    }

    /// What the rungs, ends and freed slots do after a population step (its step
    /// `env_step`; each member at its own): members at a rung are decided ([`Self::rung`]),
    /// members at the run's end are scored ([`Self::finish_members`]); each freed slot takes
    /// the next waiting trial (`PopMembers::replace`, new environments) or is dropped. False
    /// once no member is left (every trial is done).
    #[allow(clippy::too_many_arguments)]
    fn after_step(
        &mut self,
        base: &RunConfig,
        data: &Dataset,
        pop: &mut dyn PopMembers,
        envs: &mut Vec<TrainEnv>,
        params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
        out: &Path,
        env_step: u64,
        cfgs: &[RunConfig],
        make_envs: &dyn Fn(&[usize]) -> Result<Vec<TrainEnv>>,
    ) -> Result<bool> {
        let local: Vec<u64> = (0..pop.len()).map(|k| pop.member_env_steps(k)).collect::<Result<_>>()?;
        // A member at or past the end takes no rung (PPO: none after its last iteration).
        let mut racing: Vec<u64> = local.iter().map(|&l| if l >= base.steps { 0 } else { l }).collect();
        let mut freed = Vec::new();
        // PPO may pass several rungs in one iteration: each is a cut of its own, and a
        // stopped member meets no later one.
        while !self.arrivals(&racing).is_empty() {
            for k in self.rung(base, data, &*pop, params, out, env_step, &racing)? {
                racing[k] = 0;
                freed.push(k);
            }
        }
        let done: Vec<usize> = (0..pop.len()).filter(|&k| local[k] >= base.steps && !freed.contains(&k)).collect();
        if !done.is_empty() {
            self.finish_members(base, data, &*pop, params, out, &done)?;
            freed.extend(done);
        }
        freed.sort_unstable();
        let mut dropped = Vec::new();
        for k in freed {
            match self.refill(k) {
                Some(t) => {
                    pop.replace(k, &cfgs[t])
                        .with_context(|| format!("trial {t} taking trial slot {k} at env step {env_step}"))?;
                    envs[k] = make_envs(&[t])?.remove(0);
                }
                None => dropped.push(k),
            }
        }
        self.drop_slots(pop, envs, &dropped)
    }

    /// Members `ks` trained to the end while others go on (members with their own clocks):
    /// their rows, scored on the validation split (their weights saved), join `finished`.
    #[allow(clippy::too_many_arguments)]
    fn finish_members(
        &mut self,
        base: &RunConfig,
        data: &Dataset,
        pop: &dyn PopMembers,
        params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
        out: &Path,
        ks: &[usize],
    ) -> Result<()> {
        let trials: Vec<usize> = ks.iter().map(|&k| self.alive[k]).collect();
        let (applied, skipped) = pop.counters()?;
        let pick = |v: &[u64]| ks.iter().map(|&k| v[k]).collect::<Vec<u64>>();
        let member = |i: usize| Ok((pop.weights(ks[i])?, pop.policy(ks[i])?));
        let rows = score_members(base, data, &trials, params, out, &pick(&applied), &pick(&skipped), &member)?;
        self.finished.extend(rows);
        Ok(())
    }

    /// The next waiting trial for freed slot `k` (None: none waits); the slot's clocks start
    /// again at its first rung.
    fn refill(&mut self, k: usize) -> Option<usize> {
        if self.queue.is_empty() {
            return None;
        }
        let t = self.queue.remove(0);
        self.alive[k] = t;
        self.next_rung[k] = 0;
        Some(t)
    }

    /// Slots freed with no trial waiting dropped from the population and the environments;
    /// false (nothing dropped) when that would leave no member, which ends the wave.
    fn drop_slots(&mut self, pop: &mut dyn PopMembers, envs: &mut Vec<TrainEnv>, slots: &[usize]) -> Result<bool> {
        if slots.is_empty() {
            return Ok(true);
        }
        let keep: Vec<usize> = (0..self.alive.len()).filter(|k| !slots.contains(k)).collect();
        if keep.is_empty() {
            self.alive.clear();
            self.next_rung.clear();
            return Ok(false);
        }
        pop.retain(&keep)?;
        let mut old = std::mem::take(envs).into_iter().map(Some).collect::<Vec<_>>();
        *envs = keep.iter().filter_map(|&k| old[k].take()).collect();
        self.alive = keep.iter().map(|&k| self.alive[k]).collect();
        self.next_rung = keep.iter().map(|&k| self.next_rung[k]).collect();
        Ok(true)
    }

    /// The wave's rows in trial order: those finished at the end (`finished`, with the ones
    /// that finished earlier), the stopped ones, each with its rung scores; the rungs'
    /// decisions go into the wave's summary.
    fn finish(mut self, finished: Vec<TrialRow>, summary: &mut serde_json::Value) -> Vec<TrialRow> {
        let mut rows: Vec<TrialRow> = finished
            .into_iter()
            .chain(std::mem::take(&mut self.finished))
            .chain(std::mem::take(&mut self.stopped))
            .collect();
        for r in &mut rows {
            r.rungs = self.scores.remove(&r.trial).unwrap_or_default();
        }
        rows.sort_by_key(|r| r.trial);
        summary["halving"] = json!(self.log);
        rows
    }
}

/// What a population trains on: the device, the base config's data and its training
/// split's rows for the environments ([`trial_envs`]).
fn population_inputs(base: &RunConfig) -> Result<(Device, Dataset, Arc<fx_kernels::EnvData>)> {
    let device = crate::run_start::device_for(base)?;
    let data = Dataset::load(base, None)?;
    let train_rows = data.env_data(data.splits.train.clone(), base.env.episode_len + 1)?;
    Ok((device, data, train_rows))
}

/// Each trial's training environments (its own seed) over the training rows.
fn trial_envs(
    rows: &Arc<fx_kernels::EnvData>,
    cfgs: &[RunConfig],
    trials: &[usize],
    device: &Device,
) -> Result<Vec<TrainEnv>> {
    trials.iter().map(|&t| TrainEnv::new(rows.clone(), cfgs[t].env.clone(), device)).collect()
}

/// What scoring needs of a trained member `k`: its final weights (spec names, as a run's
/// network file) and its greedy policy on the CPU.
type Member<'a> = dyn Fn(usize) -> Result<(fx_models::ParamStore, fx_models::mlp::cpu::CpuPolicy)> + 'a;

/// The objective: each member's greedy policy backtested on the validation split (the test
/// split is left to the best trials' run folders); saves each trial's final weights in
/// `weights/` and returns the trials' rows.
#[allow(clippy::too_many_arguments)]
fn score_members(
    base: &RunConfig,
    data: &Dataset,
    trials: &[usize],
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    out: &Path,
    applied: &[u64],
    skipped: &[u64],
    member: &Member<'_>,
) -> Result<Vec<TrialRow>> {
    let valid = data.splits.valid.clone();
    let mut rows = Vec::with_capacity(trials.len());
    let weights = out.join("weights");
    std::fs::create_dir_all(&weights).with_context(|| format!("creating {}", weights.display()))?;
    let mut policies = Vec::with_capacity(trials.len());
    for (k, &trial) in trials.iter().enumerate() {
        let (store, policy) = member(k)?;
        store.save(&weights.join(format!("trial-{trial}.safetensors")))?;
        policies.push(policy);
    }
    for (k, (&trial, s)) in trials.iter().zip(score_policies(base, data, &valid, policies)?).enumerate() {
        rows.push(member_row(trial, params(trial), &s, applied[k], skipped[k]));
    }
    Ok(rows)
}

/// A DQN / PPO trial's row from its greedy policy's validation statistics and its
/// optimiser counters: `ok`, or `diverged` (a non-finite Sharpe or no applied update).
fn member_row(
    trial: usize,
    params: BTreeMap<String, serde_json::Value>,
    s: &fx_models::BacktestStats,
    applied: u64,
    skipped: u64,
) -> TrialRow {
    let ok = s.sharpe.is_finite() && applied > 0;
    TrialRow {
        trial,
        params,
        val_sharpe: s.sharpe,
        val_total_return: s.total_return,
        val_max_drawdown: s.max_drawdown,
        updates: applied,
        skipped_updates: skipped,
        status: if ok { "ok" } else { "diverged" }.into(),
        pbt: Vec::new(),
        val_loss: None,
        epochs: None,
        env_steps: None,
        rungs: Vec::new(),
    }
}

/// [`policy_stats`] of each of `policies` through [`fx_hw::par_map`] (each backtest is its
/// policy's alone, so the results do not depend on how they are spread): the population
/// waits for its scoring.
fn score_policies(
    cfg: &RunConfig,
    data: &Dataset,
    span: &std::ops::Range<usize>,
    policies: Vec<fx_models::mlp::cpu::CpuPolicy>,
) -> Result<Vec<fx_models::BacktestStats>> {
    // A policy acts through `&mut` (its scratch buffers): each is locked by the one worker
    // that scores it, never contended.
    let cells: Vec<std::sync::Mutex<fx_models::mlp::cpu::CpuPolicy>> =
        policies.into_iter().map(std::sync::Mutex::new).collect();
    fx_hw::par_map(&cells, |p| policy_stats(cfg, data, span, &mut p.lock().unwrap_or_else(|e| e.into_inner())))?
        .into_iter()
        .collect()
}

/// A greedy CPU policy's backtest statistics on `span` (a panel's: its equal-weight
/// portfolio), the objective on the validation split and the PBT best's test score.
fn policy_stats(
    cfg: &RunConfig,
    data: &Dataset,
    span: &std::ops::Range<usize>,
    policy: &mut fx_models::mlp::cpu::CpuPolicy,
) -> Result<fx_models::BacktestStats> {
    Ok(crate::report::backtest_span(cfg, data, span, &mut |obs| Ok(policy.act(obs)?))?.agent.stats)
}

/// [`train_population`] for PPO: the members' iterations together
/// ([`PpoPopulation::iterate`]) until each has taken the run's `steps` env steps, as a run
/// does (whole rollouts, so the last may pass `steps`).
#[allow(clippy::too_many_arguments)]
fn train_ppo_population(
    base: &RunConfig,
    cfgs: &[RunConfig],
    trials: &[usize],
    params: &dyn Fn(usize) -> BTreeMap<String, serde_json::Value>,
    dir: &WaveDir<'_>,
    pbt: Option<&PbtPlan<'_>>,
    halving: Option<&HalvingConfig>,
    slots: usize,
    stop: &mut dyn FnMut() -> bool,
) -> Result<Option<(Vec<TrialRow>, serde_json::Value)>> {
    let out = dir.out;
    let (device, data, rows) = population_inputs(base)?;
    let make_envs = |ts: &[usize]| trial_envs(&rows, cfgs, ts, &device);
    // The group's own shape (trials are grouped by it), not the base config's.
    let first = &cfgs[trials[0]];
    let num_envs = first.env.num_envs;
    let mut ck = dir.checkpoint(trials);
    let start = slots.clamp(1, trials.len());
    let fresh = || {
        let members: Vec<PpoConfig> = trials[..start].iter().map(|&t| cfgs[t].ppo.clone()).collect();
        PpoPopulation::new(members, num_envs, &device).context("building the sweep's population")
    };
    let load = |p: &Path| PpoPopulation::load_state(p, &device);
    let (mut pop, mut envs, mut w) =
        wave_state::open(&ck, trials, slots, base, params, pbt, halving, &make_envs, load, fresh)?;
    let n = pop.len();
    println!(
        "sweep: trials {:?} as one PPO population of {n} on {}, {} env steps x {num_envs} accounts each{}",
        trials,
        if device.is_cuda() { "cuda" } else { "cpu" },
        base.steps,
        if trials.len() > n {
            format!(" (a freed slot takes the next of the {} trials)", trials.len())
        } else {
            String::new()
        }
    );
    let mut busy = crate::gpu_busy::GpuBusy::for_device(&device);
    let t0 = Instant::now();
    let prior_s = w.train_seconds;
    // With halving, members keep their own clocks (see the DQN loop).
    while w.halving.as_ref().map_or(w.env_steps < base.steps, |h| !h.alive.is_empty()) {
        w.train_seconds = prior_s + t0.elapsed().as_secs_f64();
        if ck.before_step(stop(), w.env_steps, &device, || pop.snapshot(), &envs, &w)? {
            return Ok(None);
        }
        let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e.as_vec_env()).collect();
        let st = pop.iterate(&mut refs)?;
        let env_steps = pop.env_steps();
        let rows = (first.ppo.num_steps * num_envs) as u64;
        w.samples += rows * first.ppo.epochs as u64 * st.len() as u64;
        let mean = st.iter().map(|s| s.mean_reward).sum::<f64>() / st.len() as f64;
        println!("sweep: env step {env_steps}/{}: mean reward over trials {mean:.3e}", base.steps);
        // A rung at the first iteration boundary at or past it, none after a member's last
        // iteration (each rung passed is a cut of its own).
        if let Some(h) = w.halving.as_mut() {
            if !h.after_step(base, &data, &mut pop, &mut envs, params, out, env_steps, cfgs, &make_envs)? {
                w.env_steps = env_steps;
                break;
            }
        }
        // A round at the first iteration boundary at or past each multiple of `every` (an
        // iteration is num_steps env steps), none after the last iteration.
        if let Some(plan) = pbt.filter(|p| env_steps / p.cfg.every > w.last_round && env_steps < base.steps) {
            let t = Instant::now();
            w.last_round = env_steps / plan.cfg.every;
            pbt_round(plan, base, &data, &mut pop, trials, &mut w.points, &mut w.events, env_steps)?;
            w.pbt_seconds += t.elapsed().as_secs_f64();
            w.rounds += 1;
        }
        w.env_steps = env_steps;
    }
    device.synchronize()?;
    let train_s = prior_s + t0.elapsed().as_secs_f64();
    // Under halving every member may be done already (scored as it finished or stopped):
    // then no member is left to score here.
    let summary =
        wave_summary(slots.min(trials.len()), trials.len(), &device, w.env_steps, train_s, w.samples, &mut busy);
    let (applied, skipped) = pop.counters()?;
    let member = |k: usize| Ok((pop.params().member(k)?, ppo_member_policy(&pop, k)?));
    end_wave(base, &data, w, params, out, &applied, &skipped, &member, pbt.is_some(), summary).map(Some)
}

/// A population wave's figures for `population.json`, and its printed line: members (at
/// once: the slots) and trials, device, env steps, training seconds, update samples per second and, on a GPU, the share
/// of the training time a kernel ran (`gpu_busy`: the driver's utilisation samples, as for
/// a run; null on the CPU or without NVML, the reason printed).
fn wave_summary(
    n: usize,
    trials: usize,
    device: &Device,
    env_steps: u64,
    train_s: f64,
    samples: u64,
    busy: &mut crate::gpu_busy::GpuBusy,
) -> serde_json::Value {
    let fraction = busy.total();
    let rate = samples as f64 / train_s.max(1e-9);
    let busy_text = match (fraction, &busy.unavailable) {
        (Some(b), _) => format!("; GPU busy {:.1}% of it", 100.0 * b),
        (None, Some(why)) => format!("; GPU busy not measured: {why}"),
        (None, None) => String::new(),
    };
    let at_once = if trials > n { format!(", {n} at once") } else { String::new() };
    println!("sweep: trained {trials} trials{at_once} in {train_s:.1} s ({rate:.3e} update samples/s{busy_text})");
    json!({
        "members": n,
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
        "env_steps": env_steps,
        "train_seconds": train_s,
        "update_samples_per_s": rate,
        "gpu_busy_fraction": fraction,
    })
}

fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// A trial's objective, larger is better: the validation Sharpe (DQN, PPO) or the negated
/// best validation loss (forecasters); NaN for a diverged trial.
fn objective(r: &TrialRow) -> f64 {
    match (r.status.as_str(), r.val_loss) {
        ("ok", Some(loss)) => -loss,
        ("ok", None) => r.val_sharpe,
        _ => f64::NAN,
    }
}

/// Trial indices, best objective first; then trials successive halving stopped (the
/// later their rung the earlier, then by their metric there); diverged trials last; ties by
/// index.
fn leaderboard(rows: &[TrialRow]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..rows.len()).collect();
    let key = |r: &TrialRow| match r.status.as_str() {
        // A forecaster's lowest loss, a DQN / PPO trial's highest Sharpe at its rung.
        "stopped" => (
            1,
            u64::MAX - r.epochs.map(|e| e as u64).or(r.env_steps).unwrap_or(0),
            r.val_loss.or(Some(-r.val_sharpe).filter(|x| x.is_finite())).unwrap_or(f64::INFINITY),
        ),
        _ => match Some(objective(r)).filter(|o| o.is_finite()) {
            Some(o) => (0, 0, -o),
            None => (2, 0, 0.0),
        },
    };
    idx.sort_by(|&a, &b| {
        let (x, y) = (key(&rows[a]), key(&rows[b]));
        x.0.cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.total_cmp(&y.2)).then(a.cmp(&b))
    });
    idx
}

fn print_board(board: &[usize], rows: &[TrialRow], out: &Path) {
    println!("leaderboard of {} ({} trials tried; validation split):", out.display(), rows.len());
    // Forecasters rank by validation loss; their Sharpe is the forecasts' sign strategy.
    let loss = rows.iter().any(|r| r.val_loss.is_some());
    if loss {
        println!(
            "{:>4}  {:>5}  {:>10}  {:>10}  {:>10}  {:>8}  params",
            "rank", "trial", "val loss", "val sharpe", "val return", "status"
        );
    } else {
        println!("{:>4}  {:>5}  {:>10}  {:>10}  {:>8}  params", "rank", "trial", "val sharpe", "val return", "status");
    }
    for (rank, &i) in board.iter().take(10).enumerate() {
        let r = &rows[i];
        let mut params: Vec<String> = r.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        if let Some(last) = r.pbt.last() {
            let now: Vec<String> = last.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
            params.push(format!("(PBT: {} copies, ended with {})", r.pbt.len(), now.join(" ")));
        }
        let lead = if loss { format!("{:>10.4}  ", r.val_loss.unwrap_or(f64::NAN)) } else { String::new() };
        println!(
            "{:>4}  {:>5}  {lead}{:>10.3}  {:>10.4}  {:>8}  {}",
            rank + 1,
            r.trial,
            r.val_sharpe,
            r.val_total_return,
            r.status,
            params.join(" ")
        );
    }
}

fn read_rows(path: &Path) -> Result<Option<Vec<TrialRow>>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = fx_data::files::read_regular_to_string(path, u64::MAX)
        .with_context(|| format!("reading {}", path.display()))?;
    let rows = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), i + 1)))
        .collect::<Result<Vec<TrialRow>>>()?;
    Ok(Some(rows))
}

/// `trials.jsonl` and `trials.csv`, each written to a temporary file and renamed.
fn write_rows(out: &Path, rows: &[TrialRow]) -> Result<()> {
    let mut jsonl = String::new();
    for r in rows {
        jsonl.push_str(&serde_json::to_string(r)?);
        jsonl.push('\n');
    }
    crate::run_dir::write_atomic(&out.join("trials.jsonl"), jsonl.as_bytes())?;
    let keys: Vec<&String> = rows.first().map(|r| r.params.keys().collect()).unwrap_or_default();
    let mut csv = String::from("trial");
    for k in &keys {
        csv.push(',');
        csv.push_str(k);
    }
    csv.push_str(
        ",val_sharpe,val_total_return,val_max_drawdown,updates,skipped_updates,status,val_loss,epochs,env_steps\n",
    );
    for r in rows {
        csv.push_str(&r.trial.to_string());
        for k in &keys {
            csv.push(',');
            csv.push_str(&r.params[*k].to_string().replace(',', ";"));
        }
        csv.push_str(&format!(
            ",{},{},{},{},{},{},{},{},{}\n",
            r.val_sharpe,
            r.val_total_return,
            r.val_max_drawdown,
            r.updates,
            r.skipped_updates,
            r.status,
            r.val_loss.map(|l| l.to_string()).unwrap_or_default(),
            r.epochs.map(|e| e.to_string()).unwrap_or_default(),
            r.env_steps.map(|e| e.to_string()).unwrap_or_default()
        ));
    }
    crate::run_dir::write_atomic(&out.join("trials.csv"), csv.as_bytes())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_keys_set_nested_values_and_typos_name_the_trial() {
        let mut t = toml::Table::new();
        set_dotted(&mut t, "dqn.optimizer.lr", toml::Value::Float(3e-4)).unwrap();
        set_dotted(&mut t, "steps", toml::Value::Integer(10)).unwrap();
        assert_eq!(t["dqn"]["optimizer"]["lr"].as_float(), Some(3e-4));
        let spec = SweepConfig {
            trials: Some(1),
            seed: 0,
            sampler: Sampler::Random,
            best: 1,
            members: None,
            shards: None,
            run: t,
            space: BTreeMap::new(),
            pbt: None,
            tpe: None,
            halving: None,
            checkpoint_minutes: None,
        };
        let cfgs = trial_configs(&spec, &[vec![("dqn.gama".into(), toml::Value::Float(0.9))]]);
        let e = format!("{:#}", cfgs.unwrap_err());
        assert!(e.starts_with("[space] key \"dqn.gama\" = 0.9 (trial 0): unknown field `gama`"), "{e}");
        assert!(!e.contains("line") && !e.contains('\n'), "names the key, not a generated line: {e}");
        let ok = trial_configs(&spec, &[vec![("dqn.gamma".into(), toml::Value::Float(0.9))]]).unwrap();
        assert_eq!((ok[0].dqn.gamma, ok[0].dqn.optimizer.lr, ok[0].steps), (0.9, 3e-4, 10));
    }

    /// Runs `args` with a stop requested at the `at`-th check (once per env step): it must
    /// report an interruption.
    fn stop_at_check(args: &SweepArgs, at: usize) {
        let mut calls = 0;
        let mut stop = || {
            calls += 1;
            calls == at
        };
        assert!(matches!(run_with(args, &mut stop).unwrap(), Outcome::Interrupted));
    }

    /// Runs `args` to the end (it must finish) and returns how many checks (env steps) it made.
    fn finish_counting_checks(args: &SweepArgs) -> usize {
        let mut calls = 0;
        let mut count = || {
            calls += 1;
            false
        };
        assert!(matches!(run_with(args, &mut count).unwrap(), Outcome::Finished));
        calls
    }

    /// [`tiny_sweep_with`] of 6 trials learning from env step 4, as a `model` (`dqn` or
    /// `ppo`: PPO iterations of 4 env steps) sweep writing to `dir/{model}-{name}`.
    fn six_trial_sweep(dir: &Path, model: &str, name: &str, extra: &str, members: usize) -> SweepArgs {
        let args = tiny_sweep_with(dir, members, extra, &format!("{model}-{name}.toml"));
        let mut text = std::fs::read_to_string(args.config.as_ref().unwrap())
            .unwrap()
            .replace("trials = 4", "trials = 6")
            .replace("learning_starts = 32", "learning_starts = 4");
        if model == "ppo" {
            text = text
                .replace("model = \"dqn\"", "model = \"ppo\"")
                .replace("\"dqn.optimizer.lr\"", "\"ppo.optimizer.lr\"")
                + "[run.ppo]\nnum_steps = 4\nepochs = 1\nminibatch_size = 8\n[run.ppo.net]\nhidden = 16\n";
        }
        std::fs::write(args.config.as_ref().unwrap(), text).unwrap();
        SweepArgs { out: Some(dir.join(format!("{model}-{name}"))), ..args }
    }

    /// A tiny CPU sweep file: 4 trials over lr and seed, no best runs.
    fn tiny_sweep(dir: &Path, members: usize) -> SweepArgs {
        tiny_sweep_with(dir, members, "", "sweep.in.toml")
    }

    /// [`tiny_sweep`] with `extra` at the end of the file, written as `name`.
    fn tiny_sweep_with(dir: &Path, members: usize, extra: &str, name: &str) -> SweepArgs {
        let text = r#"
trials = 4
seed = 3
sampler = "sobol"
best = 0
[space]
"dqn.optimizer.lr" = { log_uniform = [1e-4, 1e-2] }
seed = { int = [0, 99] }
[run]
model = "dqn"
steps = 24
log_every = 12
device = "cpu"
[run.synthetic]
bars = 400
[run.env]
num_envs = 2
episode_len = 16
[run.dqn]
batch_size = 16
replay_capacity = 500
learning_starts = 32
[run.dqn.net]
state_dim = 56
hidden = 16
n_actions = 3
"#;
        let config = dir.join(name);
        std::fs::write(&config, format!("{text}{extra}")).unwrap();
        SweepArgs {
            config: Some(config),
            out: Some(dir.join(format!("out-{members}"))),
            shard: None,
            report: Vec::new(),
            trials: None,
            steps: None,
            epochs: None,
            device: None,
            members: Some(members),
        }
    }

    /// Trials split into waves give the rows of one population (a member is its solo run),
    /// and a sweep stopped in its second wave goes on to the same rows, training only what
    /// was not finished.
    #[test]
    fn waves_and_a_stopped_sweep_give_the_rows_of_one_population() {
        let dir = tempfile::tempdir().unwrap();
        let one = tiny_sweep(dir.path(), 4);
        assert!(matches!(run_with(&one, &mut || false).unwrap(), Outcome::Finished));
        let want = std::fs::read_to_string(one.out.as_ref().unwrap().join("trials.jsonl")).unwrap();
        assert_eq!(want.lines().count(), 4);
        for l in want.lines() {
            let r: TrialRow = serde_json::from_str(l).unwrap();
            assert!(r.updates > 0 && r.val_sharpe.is_finite(), "every trial trains: {r:?}");
        }

        let waves = tiny_sweep(dir.path(), 2);
        let w_out = waves.out.clone().unwrap();
        // Stop at env step 20 of the second wave (24 steps a wave): 19 steps done, the
        // updates under way since step 16 (32 transitions of 2 accounts).
        stop_at_check(&waves, 44);
        let half = std::fs::read_to_string(w_out.join("trials.jsonl")).unwrap();
        assert_eq!(half.lines().count(), 2, "the first wave's rows are kept");
        assert!(!w_out.join("sweep.json").exists());
        assert!(w_out.join("waves/wave-2.safetensors").exists(), "the wave in flight is checkpointed");
        assert!(!w_out.join("waves/wave-0.safetensors").exists(), "a finished wave's checkpoint is removed");
        // Stopped again at its first step (nothing trained in between), then to the end.
        stop_at_check(&waves, 1);
        assert_eq!(finish_counting_checks(&waves), 5, "the second wave goes on from env step 20");
        assert_eq!(std::fs::read_to_string(w_out.join("trials.jsonl")).unwrap(), want);
        assert!(!w_out.join("waves/wave-2.safetensors").exists());
        // Checkpoints every step (the periodic path) change nothing; a checkpoint of another
        // wave (here 2 trials where the wave is now 4) is not resumed: that wave starts again.
        let every = tiny_sweep_with(dir.path(), 2, "", "every.toml");
        let text = std::fs::read_to_string(every.config.as_ref().unwrap()).unwrap();
        std::fs::write(
            every.config.as_ref().unwrap(),
            text.replace("best = 0\n", "best = 0\ncheckpoint_minutes = 1e-9\n"),
        )
        .unwrap();
        let every = SweepArgs { out: Some(dir.path().join("every")), ..every };
        let periodic = dir.path().join("every/waves/wave-0.safetensors");
        let mut calls = 0;
        let mut stop = || {
            calls += 1;
            // Written before the earlier steps, not by a stop.
            assert!(calls < 3 || periodic.exists(), "no periodic checkpoint by check {calls}");
            calls == 20
        };
        assert!(matches!(run_with(&every, &mut stop).unwrap(), Outcome::Interrupted));
        let wider = SweepArgs { members: Some(4), ..every.clone() };
        assert_eq!(finish_counting_checks(&wider), 24, "the 4-member wave trains from its start");
        assert_eq!(std::fs::read_to_string(dir.path().join("every/trials.jsonl")).unwrap(), want);
        let bad = SweepArgs { out: Some(dir.path().join("bad-ckpt")), ..every.clone() };
        std::fs::write(
            every.config.as_ref().unwrap(),
            text.replace("best = 0\n", "best = 0\ncheckpoint_minutes = -1\n"),
        )
        .unwrap();
        let e = format!("{:#}", run_with(&bad, &mut || false).unwrap_err());
        assert!(e.contains("checkpoint_minutes = -1") && e.contains("every.toml"), "{e}");
        let pop: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(waves.out.as_ref().unwrap().join("population.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(pop["waves"].as_array().unwrap().len(), 2);
        assert_eq!(pop["waves"][1]["trials"], json!([2, 3]));
        assert_eq!(pop["waves"][1]["members_source"], "config");
        // A finished sweep is not trained again, and rows of another sweep are refused.
        let mut never = || -> bool { panic!("trained again") };
        assert!(matches!(run_with(&waves, &mut never).unwrap(), Outcome::Finished));
        let other = SweepArgs { trials: Some(3), ..tiny_sweep(dir.path(), 2) };
        let e = format!("{:#}", run_with(&other, &mut || false).unwrap_err());
        assert!(e.contains("trials.jsonl") && e.contains("trial"), "{e}");
    }

    /// A TPE sweep of 6 trials in rounds of 3: round 0 on Sobol points, round 1 proposed
    /// from round 0's Sharpe (not the Sobol sequence's next points); stopped in round 1 and
    /// run again, it trains only round 1 and ends with the uninterrupted sweep's rows.
    #[test]
    fn tpe_sweep_proposes_rounds_and_resumes_to_the_same_rows() {
        let dir = tempfile::tempdir().unwrap();
        let tpe_args = |out: &str| {
            let a = tiny_sweep_with(dir.path(), 3, "[tpe]\nstartup = 3\nbatch = 3\n", "tpe.in.toml");
            let path = a.config.clone().unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            std::fs::write(
                &path,
                text.replace("sampler = \"sobol\"", "sampler = \"tpe\"").replace("trials = 4", "trials = 6"),
            )
            .unwrap();
            SweepArgs { out: Some(dir.path().join(out)), ..a }
        };
        let whole = tpe_args("whole");
        assert!(matches!(run_with(&whole, &mut || false).unwrap(), Outcome::Finished));
        let want = std::fs::read_to_string(whole.out.as_ref().unwrap().join("trials.jsonl")).unwrap();
        let rows: Vec<TrialRow> = want.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(rows.len(), 6);
        let spec = SweepConfig::from_file(whole.config.as_ref().unwrap()).unwrap();
        let space: Vec<(String, Dim)> = spec.space.clone().into_iter().collect();
        let sobol = space::units(&space, Sampler::Sobol, 6, spec.seed).unwrap();
        let json_of = |u: &[f64]| -> BTreeMap<String, serde_json::Value> {
            space::point_at(&space, u).iter().map(|(k, v)| (k.clone(), toml_to_json(v))).collect()
        };
        for t in 0..3 {
            assert_eq!(rows[t].params, json_of(&sobol[t]), "round 0 is Sobol's");
        }
        assert!((3..6).any(|t| rows[t].params != json_of(&sobol[t])), "round 1 is TPE's");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(whole.out.as_ref().unwrap().join("sweep.json")).unwrap())
                .unwrap();
        assert_eq!(doc["tpe"]["rounds"], 2, "{doc}");

        let stopped = tpe_args("stopped");
        stop_at_check(&stopped, 25);
        assert_eq!(finish_counting_checks(&stopped), 24, "only round 1 trains again");
        assert_eq!(std::fs::read_to_string(stopped.out.as_ref().unwrap().join("trials.jsonl")).unwrap(), want);
        // TPE with [pbt] or shards is refused, and a [tpe] section without the sampler.
        let both = tpe_args("both");
        let path = both.config.clone().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{text}[pbt]\nevery = 12\n")).unwrap();
        let e = format!("{:#}", run_with(&both, &mut || false).unwrap_err());
        assert!(e.contains("[pbt]") && e.contains("tpe"), "{e}");
        let sharded = SweepArgs { shard: Some("0/2".into()), ..tpe_args("sharded") };
        let e = format!("{:#}", run_with(&sharded, &mut || false).unwrap_err());
        assert!(e.contains("not sharded"), "{e}");
        let plain = tiny_sweep_with(dir.path(), 3, "[tpe]\nstartup = 3\n", "plain.in.toml");
        let e = format!("{:#}", run_with(&plain, &mut || false).unwrap_err());
        assert!(e.contains("[tpe] section needs sampler"), "{e}");
    }

    /// Trials of different widths train as separate populations.
    /// Two shards of a sweep (run with different `members`), merged by `--report`, give the
    /// unsharded sweep's rows and leaderboard; a shard trains only its trials; another
    /// shard's folder and overlapping folders are refused.
    #[test]
    fn two_shards_merge_into_the_unsharded_leaderboard() {
        let dir = tempfile::tempdir().unwrap();
        let whole = tiny_sweep(dir.path(), 8);
        run_with(&whole, &mut || false).unwrap();
        let mut shards = Vec::new();
        for i in 0..2 {
            // The second shard's device holds one trial at a time: its sweep.toml differs in
            // `members` only, which changes no result.
            let mut a = tiny_sweep(dir.path(), if i == 0 { 8 } else { 1 });
            a.out = Some(dir.path().join(format!("shard-{i}")));
            a.shard = Some(format!("{i}/2"));
            run_with(&a, &mut || false).unwrap();
            let rows = read_rows(&a.out.as_ref().unwrap().join("trials.jsonl")).unwrap().unwrap();
            assert!(rows.iter().all(|r| r.trial % 2 == i) && rows.len() == 2, "shard {i}: {rows:?}");
            shards.push(a.out.unwrap());
        }
        let merged = dir.path().join("merged");
        let r = SweepArgs {
            config: None,
            out: Some(merged.clone()),
            shard: None,
            report: shards.clone(),
            ..tiny_sweep(dir.path(), 8)
        };
        run_with(&r, &mut || false).unwrap();
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        let w = whole.out.as_ref().unwrap();
        assert_eq!(read(merged.join("trials.jsonl")), read(w.join("trials.jsonl")));
        assert_eq!(read(merged.join("trials.csv")), read(w.join("trials.csv")));
        let board = |p: PathBuf| serde_json::from_str::<serde_json::Value>(&read(p)).unwrap()["leaderboard"].clone();
        assert_eq!(board(merged.join("sweep.json")), board(w.join("sweep.json")));
        // Another shard's folder is refused by name; the same folder twice overlaps.
        let mut wrong = tiny_sweep(dir.path(), 8);
        (wrong.out, wrong.shard) = (Some(shards[0].clone()), Some("1/2".into()));
        assert!(run_with(&wrong, &mut || false).unwrap_err().to_string().contains("is not in shard 1/2"));
        let twice = SweepArgs { report: vec![shards[0].clone(), shards[0].clone()], out: None, ..r };
        assert!(run_with(&twice, &mut || false).unwrap_err().to_string().contains("appears in two"));
    }

    /// `--shard`, SLURM arrays and Kubernetes indices pick a shard; bad values are refused.
    #[test]
    fn shards_come_from_the_flag_slurm_or_kubernetes() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let none = env(&[]);
        assert_eq!(shard_of(None, None, &none).unwrap(), None);
        assert_eq!(shard_of(Some("1/4"), None, &none).unwrap(), Some((1, 4)));
        let slurm =
            env(&[("SLURM_ARRAY_TASK_ID", "7"), ("SLURM_ARRAY_TASK_COUNT", "4"), ("SLURM_ARRAY_TASK_MIN", "5")]);
        assert_eq!(shard_of(None, None, &slurm).unwrap(), Some((2, 4)));
        assert_eq!(shard_of(Some("0/2"), None, &slurm).unwrap(), Some((0, 2)), "the flag wins");
        let k8s = env(&[("JOB_COMPLETION_INDEX", "3")]);
        assert_eq!(shard_of(None, Some(5), &k8s).unwrap(), Some((3, 5)));
        assert_eq!(shard_of(None, None, &k8s).unwrap(), None, "an index without the file's shards");
        for bad in ["4/4", "1", "a/2", "0/0"] {
            let e = shard_of(Some(bad), None, &none).unwrap_err().to_string();
            assert!(e.contains("--shard") && !e.contains('\n'), "{bad}: {e}");
        }
        assert!(shard_of(None, Some(3), &env(&[("JOB_COMPLETION_INDEX", "3")])).is_err());
    }

    #[test]
    fn shape_keys_split_trials_into_populations() {
        let dir = tempfile::tempdir().unwrap();
        let args = tiny_sweep(dir.path(), 8);
        let mut spec = SweepConfig::from_file(args.config.as_ref().unwrap()).unwrap();
        spec.space.insert("dqn.net.hidden".into(), toml::from_str::<Dim>("choice = [16, 32]").unwrap());
        let space: Vec<(String, Dim)> = spec.space.clone().into_iter().collect();
        let points = space::sample(&space, spec.sampler, spec.trials, spec.seed).unwrap();
        let cfgs = trial_configs(&spec, &points).unwrap();
        let base = cfgs[0].clone();
        let all: Vec<usize> = (0..cfgs.len()).collect();
        let waves = plan_waves(&base, &cfgs, &all, Some(8), false).unwrap();
        let mut all: Vec<usize> = waves.iter().flat_map(|w| w.trials.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2, 3]);
        for w in &waves {
            let h: Vec<usize> = w.trials.iter().map(|&t| cfgs[t].dqn.net.hidden).collect();
            assert!(h.iter().all(|&x| x == h[0]), "{waves:?}");
        }
        let widths: std::collections::BTreeSet<usize> = cfgs.iter().map(|c| c.dqn.net.hidden).collect();
        assert_eq!(waves.len(), widths.len(), "{waves:?}");
        let small = plan_waves(&base, &cfgs, &all, Some(1), false).unwrap();
        assert_eq!(small.len(), 4);
    }

    /// A PBT sweep: two rounds (env steps 8 and 16 of 24) in which the bottom half copies
    /// the top half with perturbed learning rates, recorded per trial, the same from the same
    /// file; the best trial's final weights are scored on the test split; sharding and PPO
    /// are refused.
    #[test]
    fn pbt_moves_the_bottom_half_onto_the_top_half_deterministically() {
        let dir = tempfile::tempdir().unwrap();
        let pbt = "[pbt]\nevery = 8\nquantile = 0.5\nfactors = [0.5, 2.0]\n";
        let mut args = tiny_sweep_with(dir.path(), 4, pbt, "pbt.toml");
        args.out = Some(dir.path().join("pbt-a"));
        assert!(matches!(run_with(&args, &mut || false).unwrap(), Outcome::Finished));
        let out = args.out.clone().unwrap();
        let rows = read_rows(&out.join("trials.jsonl")).unwrap().unwrap();
        let events: Vec<(usize, &PbtEvent)> =
            rows.iter().flat_map(|r| r.pbt.iter().map(move |e| (r.trial, e))).collect();
        assert_eq!(events.len(), 4, "two of four trials copy in each of two rounds: {rows:#?}");
        for round in [1, 2] {
            let this: Vec<_> = events.iter().filter(|(_, e)| e.round == round).collect();
            assert_eq!(this.len(), 2, "round {round}");
            for (t, e) in this {
                assert_eq!(e.env_step, 8 * round);
                assert_ne!(*t, e.copied_from);
                let lr = e.params["dqn.optimizer.lr"].as_f64().unwrap();
                assert!((1e-4..=1e-2).contains(&lr), "lr {lr} stays in the space's bounds");
                assert_eq!(e.params.len(), 1, "only the learning rate is perturbed (the seed is not)");
            }
        }
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
        assert_eq!(doc["best"].as_array().unwrap().len(), 0, "best = 0 in the tiny file");
        let pop: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("population.json")).unwrap()).unwrap();
        assert_eq!(pop["waves"][0]["pbt_rounds"], 2);

        let again = SweepArgs {
            out: Some(dir.path().join("pbt-b")),
            trials: None,
            ..tiny_sweep_with(dir.path(), 4, pbt, "pbt.toml")
        };
        let spec_best =
            std::fs::read_to_string(again.config.as_ref().unwrap()).unwrap().replace("best = 0", "best = 1");
        std::fs::write(again.config.as_ref().unwrap(), spec_best).unwrap();
        // Stopped after the first round (env step 8) and the first updates (step 16),
        // and resumed: the same schedule.
        stop_at_check(&again, 20);
        assert_eq!(finish_counting_checks(&again), 5, "it goes on from env step 20");
        let b = again.out.clone().unwrap();
        assert_eq!(read_rows(&b.join("trials.jsonl")).unwrap().unwrap(), rows, "the same file gives the same schedule");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(b.join("sweep.json")).unwrap()).unwrap();
        let best = &doc["best"][0];
        assert_eq!(best["trial"], doc["leaderboard"][0]["trial"]);
        assert!(best["test_sharpe"].is_number() || best["test_sharpe"].is_null(), "{best}");
        assert!(best["test_total_return"].as_f64().unwrap().is_finite(), "{best}");
        assert!(!b.join("best-1").exists(), "PBT's best trials get no ordinary run");

        let mut sharded = tiny_sweep_with(dir.path(), 4, pbt, "pbt.toml");
        (sharded.out, sharded.shard) = (Some(dir.path().join("pbt-s")), Some("0/2".into()));
        assert!(run_with(&sharded, &mut || false).unwrap_err().to_string().contains("not sharded"));
        // A PPO population: rounds at the iteration boundaries (4 env steps) on the multiples
        // of 8, its members copied and perturbed the same way; a DQN key is not PPO's.
        let ppo = tiny_sweep_with(dir.path(), 4, pbt, "pbt-ppo.toml");
        let text = std::fs::read_to_string(ppo.config.as_ref().unwrap())
            .unwrap()
            .replace("model = \"dqn\"", "model = \"ppo\"");
        std::fs::write(ppo.config.as_ref().unwrap(), &text).unwrap();
        let e =
            run_with(&SweepArgs { out: Some(dir.path().join("pbt-p0")), ..ppo.clone() }, &mut || false).unwrap_err();
        assert!(format!("{e:#}").contains("ppo.optimizer.lr"), "{e:#}");
        let text = text.replace("\"dqn.optimizer.lr\"", "\"ppo.optimizer.lr\"")
            + "[run.ppo]\nnum_steps = 4\nepochs = 1\nminibatch_size = 8\n[run.ppo.net]\nhidden = 16\n";
        std::fs::write(ppo.config.as_ref().unwrap(), &text).unwrap();
        let p_out = dir.path().join("pbt-p");
        run_with(&SweepArgs { out: Some(p_out.clone()), ..ppo.clone() }, &mut || false).unwrap();
        let rows = read_rows(&p_out.join("trials.jsonl")).unwrap().unwrap();
        let events: Vec<&PbtEvent> = rows.iter().flat_map(|r| r.pbt.iter()).collect();
        assert_eq!(events.len(), 4, "two of four PPO trials copy in each of two rounds: {rows:#?}");
        for e in &events {
            assert_eq!(e.env_step, 8 * e.round);
            let lr = e.params["ppo.optimizer.lr"].as_f64().unwrap();
            assert!((1e-4..=1e-2).contains(&lr), "lr {lr} stays in the space's bounds");
        }
        let pop: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p_out.join("population.json")).unwrap()).unwrap();
        assert_eq!(pop["waves"][0]["pbt_rounds"], 2);
        let again = dir.path().join("pbt-p2");
        // Stopped after its first round (two iterations of 4 env steps) and resumed.
        stop_at_check(&SweepArgs { out: Some(again.clone()), ..ppo.clone() }, 3);
        assert_eq!(finish_counting_checks(&SweepArgs { out: Some(again.clone()), ..ppo }), 4, "four iterations left");
        assert_eq!(read_rows(&again.join("trials.jsonl")).unwrap().unwrap(), rows, "the same PPO schedule");
    }

    /// Successive halving of DQN and PPO populations (6 trials, eta 2, rungs at env steps 8
    /// and 16 of 24): a trial's score at a rung is its score in a plain sweep of that many
    /// steps (a member trains to a rung as its solo run would), the rungs keep the best half
    /// by those scores (recomputed here), the stopped trials' weights are the short sweep's,
    /// and the trials that reach the end have the plain full sweep's rows and weights.
    #[test]
    fn halving_drops_the_worse_members_and_the_rest_train_on_as_solo_runs() {
        let dir = tempfile::tempdir().unwrap();
        for model in ["dqn", "ppo"] {
            let halving = "[halving]\nmin_steps = 8\neta = 2\n";
            let mk = |name: &str, extra: &str| six_trial_sweep(dir.path(), model, name, extra, 6);
            let halved = mk("halved", halving);
            run_with(&halved, &mut || false).unwrap();
            let rows = read_rows(&halved.out.as_ref().unwrap().join("trials.jsonl")).unwrap().unwrap();
            // Stopped after the first rung and again after the second (DQN: a check per env
            // step; PPO: per iteration of 4), the resumed sweep ends with the same rows and
            // every trial's weights.
            let resumed = mk("resumed", halving);
            let (first, second, rest) = if model == "dqn" { (12, 7, 7) } else { (3, 2, 3) };
            stop_at_check(&resumed, first);
            stop_at_check(&resumed, second);
            assert_eq!(finish_counting_checks(&resumed), rest, "{model}: only what was left trains");
            let r_out = resumed.out.clone().unwrap();
            assert_eq!(read_rows(&r_out.join("trials.jsonl")).unwrap().unwrap(), rows, "{model}: resumed");
            for t in 0..6 {
                let f = format!("weights/trial-{t}.safetensors");
                let h = halved.out.as_ref().unwrap();
                assert_eq!(std::fs::read(r_out.join(&f)).unwrap(), std::fs::read(h.join(&f)).unwrap(), "{model} {t}");
            }
            let plain = |steps: u64| {
                let a = SweepArgs {
                    steps: Some(steps),
                    out: Some(dir.path().join(format!("{model}-p{steps}"))),
                    ..mk(&format!("p{steps}"), "")
                };
                run_with(&a, &mut || false).unwrap();
                (read_rows(&a.out.as_ref().unwrap().join("trials.jsonl")).unwrap().unwrap(), a.out.unwrap())
            };
            let (p8, d8) = plain(8);
            let (p16, d16) = plain(16);
            let (p24, d24) = plain(24);
            let best = |alive: &[usize], rows: &[TrialRow], n: usize| -> Vec<usize> {
                let mut a = alive.to_vec();
                a.sort_by(|&x, &y| rows[y].val_sharpe.total_cmp(&rows[x].val_sharpe).then(x.cmp(&y)));
                a.truncate(n);
                a.sort_unstable();
                a
            };
            let r1 = best(&[0, 1, 2, 3, 4, 5], &p8, 3);
            let r2 = best(&r1, &p16, 2);
            let w = |d: &Path, t: usize| std::fs::read(d.join(format!("weights/trial-{t}.safetensors"))).unwrap();
            let h_out = halved.out.clone().unwrap();
            for r in &rows {
                let t = r.trial;
                let scores: Vec<(u64, f64)> = r.rungs.iter().map(|s| (s.env_step, s.val_sharpe)).collect();
                let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
                assert!(
                    same(scores[0].1, p8[t].val_sharpe) && scores[0].0 == 8,
                    "{model} trial {t} at 8: {scores:?} vs {}",
                    p8[t].val_sharpe
                );
                if r2.contains(&t) {
                    assert_eq!(scores.len(), 2);
                    assert!(same(scores[1].1, p16[t].val_sharpe), "{model} trial {t} at 16");
                    assert_eq!(TrialRow { rungs: Vec::new(), ..r.clone() }, p24[t], "{model} trial {t} finished");
                    assert_eq!(w(&h_out, t), w(&d24, t), "{model} trial {t}'s final weights");
                } else if r1.contains(&t) {
                    assert_eq!((r.env_steps, scores.len()), (Some(16), 2), "{model} trial {t}");
                    assert!(same(r.val_sharpe, p16[t].val_sharpe));
                    assert_eq!(r.updates, p16[t].updates);
                    assert_eq!(w(&h_out, t), w(&d16, t), "{model} trial {t}'s weights at 16");
                } else {
                    assert_eq!((r.env_steps, scores.len()), (Some(8), 1), "{model} trial {t}");
                    assert_eq!(w(&h_out, t), w(&d8, t), "{model} trial {t}'s weights at 8");
                }
                let stopped = !r2.contains(&t);
                assert_eq!(r.status == "stopped", stopped && p8[t].status == "ok", "{model} trial {t}: {}", r.status);
            }
            // Not a vacuous schedule: the short runs trained and their scores differ (the
            // tiny policies tie often; ties go to the lower trial index).
            let mut s8: Vec<f64> = p8.iter().map(|r| r.val_sharpe).filter(|x| x.is_finite()).collect();
            s8.sort_by(f64::total_cmp);
            s8.dedup();
            assert!(s8.len() >= 2 && p8.iter().all(|r| r.updates > 0), "{model}: {p8:?}");
            assert_eq!(rows.iter().filter(|r| r.status == "stopped").count(), 4, "{model}");
            let board = leaderboard(&rows);
            assert!(r2.contains(&rows[board[0]].trial) && r2.contains(&rows[board[1]].trial), "{model}");
            let pop: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(h_out.join("population.json")).unwrap()).unwrap();
            assert_eq!(pop["waves"][0]["halving"][0]["kept"], json!(r1), "{model}");
            assert_eq!(pop["waves"][0]["halving"][1]["kept"], json!(r2), "{model}");
            let doc: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(h_out.join("sweep.json")).unwrap()).unwrap();
            assert_eq!(doc["halving"]["rungs"], json!([8, 16, 24]));
        }
        // Refused: with [pbt], sharded, min_epochs in an RL sweep.
        for (extra, want) in [
            ("[halving]\neta = 2\n[pbt]\nevery = 8\nquantile = 0.5\nfactors = [0.5, 2.0]\n", "[pbt]"),
            ("[halving]\nmin_epochs = 2\n", "min_epochs"),
            ("[halving]\nmin_steps = 24\n", "below the run's steps"),
        ] {
            let args = tiny_sweep_with(dir.path(), 4, extra, "bad.toml");
            let e = format!(
                "{:#}",
                run_with(&SweepArgs { out: Some(dir.path().join("bad")), ..args }, &mut || false).unwrap_err()
            );
            assert!(e.contains(want), "{extra}: {e}");
        }
        let mut sharded = tiny_sweep_with(dir.path(), 4, "[halving]\nmin_steps = 8\n", "sh.toml");
        (sharded.out, sharded.shard) = (Some(dir.path().join("sh")), Some("0/2".into()));
        assert!(run_with(&sharded, &mut || false).unwrap_err().to_string().contains("shards"));
    }

    /// ASHA's rule on a hand-computed schedule (eta 2; higher Sharpe is better): the first
    /// arrivals at a rung are ranked among themselves, later ones among everyone that reached
    /// it, ties by trial index.
    #[test]
    fn asynchronous_rungs_rank_arrivals_against_everyone_before() {
        let h = HalvingConfig { min_epochs: None, min_steps: Some(2), eta: 2 };
        let mut p = PopHalving::new(&h, 8, &[0, 1, 2, 3, 4], 2).unwrap();
        assert_eq!((p.rungs.clone(), p.alive.clone(), p.queue.clone()), (vec![2, 4], vec![0, 1], vec![2, 3, 4]));
        // Trials 0 and 1 reach rung 0 together: the best ceil(2/2) = 1 goes on.
        assert_eq!(p.decide(0, &[(0, 0.5), (1, 0.9)]), [1]);
        // Trial 2 alone at 0.7: 3 reached, best ceil(3/2) = 2 are {1, 2}: it goes on.
        assert_eq!(p.decide(0, &[(2, 0.7)]), [2]);
        // Trial 3 at 0.6: best 2 of 4 are {1, 2}: it stops; trial 4 at 0.7 ties with 2: best
        // ceil(5/2) = 3 of {0.5, 0.9, 0.7, 0.6, 0.7} are 1, 2, 4.
        assert_eq!(p.decide(0, &[(3, 0.6)]), Vec::<usize>::new());
        assert_eq!(p.decide(0, &[(4, 0.7)]), [4]);
        // A NaN ranks last.
        assert_eq!(p.decide(1, &[(1, f64::NAN), (2, 0.1)]), [2]);
        // A NaN score survives a checkpoint's JSON (as null).
        let back: PopHalving = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert!(back.reached[1][0].val_sharpe.is_nan() && back.reached[1][1] == p.reached[1][1]);
        // Arrivals by rung, at or past it; a refill starts its slot's rungs again.
        p.next_rung = vec![1, 0];
        assert_eq!(p.arrivals(&[4, 1]), vec![(1, vec![0])]);
        assert_eq!(p.arrivals(&[4, 2]), vec![(0, vec![1]), (1, vec![0])]);
        assert_eq!(p.refill(0), Some(2));
        assert_eq!((p.alive.clone(), p.next_rung.clone(), p.queue.clone()), (vec![2, 1], vec![0, 0], vec![3, 4]));
        p.queue.clear();
        assert_eq!(p.refill(1), None);
    }

    /// DQN and PPO sweeps with successive halving and fewer slots than trials (6 trials, 2
    /// slots, eta 2, rungs at 8 and 16 of 24; PPO iterations of 4 env steps): a stopped or
    /// finished trial's slot takes the next
    /// trial at step 0, so every trial is its solo run from its own start. Its score at a rung
    /// is its score in a plain sweep of that length, the decisions are ASHA's on those scores
    /// (simulated here slot by slot), every trial's row and weights are the plain sweep's of
    /// the length it reached, the population never has more than 2 members, and a sweep
    /// stopped twice and resumed ends with the same rows.
    #[test]
    fn a_freed_slot_takes_the_next_trial_and_each_trial_is_its_solo_run() {
        let dir = tempfile::tempdir().unwrap();
        for model in ["dqn", "ppo"] {
            let mk = |name: &str, extra: &str, members: usize| six_trial_sweep(dir.path(), model, name, extra, members);
            let halving = "[halving]\nmin_steps = 8\neta = 2\n";
            let asha = mk("asha", halving, 2);
            run_with(&asha, &mut || false).unwrap();
            let a_out = asha.out.clone().unwrap();
            let rows = read_rows(&a_out.join("trials.jsonl")).unwrap().unwrap();
            assert_eq!(rows.len(), 6);
            let plain = |steps: u64| {
                let a = SweepArgs { steps: Some(steps), ..mk(&format!("p{steps}"), "", 6) };
                run_with(&a, &mut || false).unwrap();
                (read_rows(&a.out.as_ref().unwrap().join("trials.jsonl")).unwrap().unwrap(), a.out.unwrap())
            };
            let (p8, d8) = plain(8);
            let (p16, d16) = plain(16);
            let (p24, d24) = plain(24);
            // The reference: two slots with their own clocks, ASHA's rule on the plain scores.
            let score = |t: usize, r: usize| if r == 0 { p8[t].val_sharpe } else { p16[t].val_sharpe };
            let (mut slots, mut queue) = (vec![(0usize, 0u64, 0usize), (1, 0, 0)], vec![2usize, 3, 4, 5]);
            let mut reached: Vec<Vec<(usize, f64)>> = vec![Vec::new(); 2];
            let mut reached_len = BTreeMap::new();
            while !slots.is_empty() {
                for s in slots.iter_mut() {
                    s.1 += 1;
                }
                let mut freed = Vec::new();
                for r in 0..2 {
                    let arrived: Vec<usize> =
                        (0..slots.len()).filter(|&i| slots[i].2 == r && slots[i].1 == [8, 16][r]).collect();
                    if arrived.is_empty() {
                        continue;
                    }
                    reached[r].extend(arrived.iter().map(|&i| (slots[i].0, score(slots[i].0, r))));
                    let mut all = reached[r].clone();
                    all.sort_by(|x, y| {
                        let k = |v: f64| if v.is_finite() { -v } else { f64::INFINITY };
                        k(x.1).total_cmp(&k(y.1)).then(x.0.cmp(&y.0))
                    });
                    all.truncate(reached[r].len().div_ceil(2));
                    for i in arrived {
                        if all.iter().any(|&(t, _)| t == slots[i].0) {
                            slots[i].2 += 1;
                        } else {
                            reached_len.insert(slots[i].0, [8u64, 16][r]);
                            freed.push(i);
                        }
                    }
                }
                for (i, &(t, clock, _)) in slots.iter().enumerate() {
                    if clock == 24 {
                        reached_len.insert(t, 24);
                        freed.push(i);
                    }
                }
                freed.sort_unstable();
                for &i in freed.iter().rev() {
                    if queue.is_empty() {
                        slots.remove(i);
                    } else {
                        slots[i] = (queue.remove(0), 0, 0);
                    }
                }
            }
            let w = |d: &Path, t: usize| std::fs::read(d.join(format!("weights/trial-{t}.safetensors"))).unwrap();
            let mut finished = 0;
            for r in &rows {
                let t = r.trial;
                let len = reached_len[&t];
                let (want, d) = match len {
                    8 => (&p8[t], &d8),
                    16 => (&p16[t], &d16),
                    _ => (&p24[t], &d24),
                };
                let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
                assert!(
                    same(r.val_sharpe, want.val_sharpe),
                    "{model} trial {t} at {len}: {} vs {}",
                    r.val_sharpe,
                    want.val_sharpe
                );
                assert_eq!((r.updates, r.skipped_updates), (want.updates, want.skipped_updates), "trial {t} at {len}");
                assert_eq!(w(&a_out, t), w(d, t), "trial {t}'s weights at {len}");
                if len == 24 {
                    finished += 1;
                    assert_eq!(TrialRow { rungs: Vec::new(), ..r.clone() }, *want, "{model} trial {t} finished");
                } else {
                    assert_eq!(r.env_steps, Some(len), "trial {t}");
                }
                let scores: Vec<u64> = r.rungs.iter().map(|s| s.env_step).collect();
                assert_eq!(
                    scores,
                    [8u64, 16].iter().copied().filter(|&x| x <= len.min(16)).collect::<Vec<_>>(),
                    "trial {t}"
                );
            }
            assert!(finished >= 1 && reached_len.values().filter(|&&l| l == 8).count() >= 2, "{reached_len:?}");
            let pop: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(a_out.join("population.json")).unwrap()).unwrap();
            assert_eq!(pop["waves"].as_array().unwrap().len(), 1, "one population fed by the queue");
            let doc: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(a_out.join("sweep.json")).unwrap()).unwrap();
            assert_eq!(doc["populations"], json!([2]));
            // Stopped twice (one check per population step) and resumed: the same rows.
            let resumed = mk("asha-resumed", halving, 2);
            let (first, second) = if model == "dqn" { (13, 20) } else { (3, 5) };
            stop_at_check(&resumed, first);
            stop_at_check(&resumed, second);
            finish_counting_checks(&resumed);
            assert_eq!(
                read_rows(&resumed.out.as_ref().unwrap().join("trials.jsonl")).unwrap().unwrap(),
                rows,
                "{model}"
            );
        }
        // Rungs off the train_every grid are refused.
        let odd = tiny_sweep_with(dir.path(), 2, "[halving]\nmin_steps = 7\neta = 2\n", "odd.toml");
        let text = std::fs::read_to_string(odd.config.as_ref().unwrap()).unwrap();
        let text = text.replacen("[run.dqn]\nbatch_size", "[run.dqn]\ntrain_every = 2\nbatch_size", 1);
        std::fs::write(odd.config.as_ref().unwrap(), text).unwrap();
        let odd = SweepArgs { out: Some(dir.path().join("odd")), ..odd };
        let e = format!("{:#}", run_with(&odd, &mut || false).unwrap_err());
        assert!(e.contains("train_every"), "{e}");
    }

    #[test]
    fn leaderboard_puts_diverged_trials_last() {
        let row = |trial, val_sharpe: f64, status: &str| TrialRow {
            trial,
            params: BTreeMap::new(),
            val_sharpe,
            val_total_return: 0.0,
            val_max_drawdown: 0.0,
            updates: 1,
            skipped_updates: 0,
            status: status.into(),
            pbt: Vec::new(),
            val_loss: None,
            epochs: None,
            env_steps: None,
            rungs: Vec::new(),
        };
        let rows = vec![row(0, 0.5, "ok"), row(1, f64::NAN, "diverged"), row(2, 1.5, "ok"), row(3, 0.5, "ok")];
        assert_eq!(leaderboard(&rows), [2, 0, 3, 1]);
        // Forecasters: the lowest validation loss first, whatever their Sharpe.
        let seq = |trial, loss: Option<f64>, status: &str| TrialRow {
            val_loss: loss,
            ..row(trial, 9.0 - trial as f64, status)
        };
        let rows =
            vec![seq(0, Some(0.9), "ok"), seq(1, None, "diverged"), seq(2, Some(0.7), "ok"), seq(3, Some(1.2), "ok")];
        assert_eq!(leaderboard(&rows), [2, 0, 3, 1]);
        // Successive halving's stopped trials after the finished ones: the later rung first,
        // then the lower loss there; diverged last.
        let at =
            |trial, loss, epochs, status: &str| TrialRow { epochs: Some(epochs), ..seq(trial, Some(loss), status) };
        let rows = vec![
            at(0, 0.5, 1, "stopped"),
            at(1, 0.9, 4, "ok"),
            at(2, 0.6, 2, "stopped"),
            at(3, 0.4, 1, "stopped"),
            TrialRow { val_loss: None, ..at(4, 0.0, 1, "diverged") },
            at(5, 0.8, 4, "ok"),
        ];
        assert_eq!(leaderboard(&rows), [5, 1, 2, 3, 0, 4]);
        // DQN / PPO: stopped at a later rung first, then the higher Sharpe there.
        let rl = |trial, sharpe, steps: Option<u64>, status: &str| TrialRow {
            env_steps: steps,
            ..row(trial, sharpe, status)
        };
        let rows = vec![
            rl(0, 2.0, Some(100), "stopped"),
            rl(1, 0.1, None, "ok"),
            rl(2, 0.5, Some(300), "stopped"),
            rl(3, 2.5, Some(100), "stopped"),
            rl(4, f64::NAN, None, "diverged"),
            rl(5, 0.2, Some(300), "stopped"),
        ];
        assert_eq!(leaderboard(&rows), [1, 2, 5, 3, 0, 4]);
    }
}
