//! `fx-train sweep --config sweep.toml --out DIR`: many DQN trials trained together as one
//! population ([`fx_models::DqnPopulation`]: one batched step for every trial, each trial
//! its own seed, environments, replay and hyperparameters), ranked by a validation-split
//! metric; the best trials are then trained again as ordinary runs (their run folders hold
//! config, checkpoint and report, so `eval`, `quantize` and `--resume` work on them, and the
//! test split is scored there, for those trials only).
//!
//! The sweep file: `trials`, `seed` (the sampler's), `sampler` (`grid`, `random`, `sobol`),
//! `best` (how many trials get run folders), `[run]` (a run config, the `train --config`
//! format: every trial's base) and `[space]` (dotted run-config keys, each
//! `{ choice = [...] }`, `{ uniform = [lo, hi] }`, `{ log_uniform = [lo, hi] }` or
//! `{ int = [lo, hi] }`). Keys that change shapes (network width, batch, replay) must be
//! equal across one population: the error names the first trial that differs.
//!
//! Outputs in DIR: `sweep.toml` (the file as run), `trials.jsonl` and `trials.csv` (one row per
//! trial: its point, validation metric and backtest, updates, skips, status), `sweep.json`
//! (how many trials were tried, the sampler, the leaderboard), `population.json` (members,
//! device, training seconds and throughput), `weights/trial-{k}.safetensors` (every trial's
//! final online network) and `best-{rank}/` run folders (on the CPU a best run ends with its
//! trial's weights exactly: a member is its solo run). The folder is locked while the sweep runs. A sweep whose
//! `trials.jsonl` is complete is not trained again: running it again prints its leaderboard
//! and finishes any best-trial run that did not end.

mod space;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use fx_kernels::VecEnv;
use fx_models::{DqnConfig, DqnPopulation, DuelingDqn};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{ModelChoice, RunConfig};
use crate::dataset::Dataset;
use crate::train_env::TrainEnv;
pub use space::{Dim, Sampler};

/// Flags of `fx-train sweep`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// The sweep file (see the module docs and the README).
    #[arg(long)]
    pub config: PathBuf,
    /// The sweep's folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Trials to run (overrides the file's `trials`).
    #[arg(long)]
    pub trials: Option<usize>,
    /// Environment steps of every trial (overrides `run.steps`).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Device: auto, cpu, cuda, cuda:N (overrides `run.device`).
    #[arg(long)]
    pub device: Option<String>,
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
    /// Every trial's base run config.
    #[serde(default)]
    pub run: toml::Table,
    /// The search space: dotted run-config key → dimension.
    #[serde(default)]
    pub space: BTreeMap<String, Dim>,
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
    /// The objective: the greedy policy's Sharpe ratio on the validation split.
    pub val_sharpe: f64,
    pub val_total_return: f64,
    pub val_max_drawdown: f64,
    pub updates: u64,
    pub skipped_updates: u64,
    /// `ok`, or `diverged` (a non-finite objective or no applied update).
    pub status: String,
}

impl SweepConfig {
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading sweep file {}", path.display()))?;
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
    points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut t = spec.run.clone();
            for (k, v) in p {
                set_dotted(&mut t, k, v.clone())?;
            }
            let text = toml::to_string(&t).context("writing a trial's config")?;
            RunConfig::from_toml_str(&text, &format!("sweep trial {i}"))?
                .resolve()
                .with_context(|| format!("sweep trial {i}"))
        })
        .collect()
}

/// The greedy policy of a member's weights on the CPU (the backtest's decisions).
fn member_policy(pop: &DqnPopulation, k: usize) -> Result<fx_models::mlp::cpu::CpuPolicy> {
    let cfg = &pop.members()[k];
    let net = DuelingDqn::new(cfg.net, &Device::Cpu, cfg.seed)?;
    let mut map = std::collections::HashMap::new();
    for (name, t) in pop.online().member(k)?.to_tensors("")? {
        map.insert(name, t.to_device(&Device::Cpu)?);
    }
    net.params().load_map(&map, &format!("sweep member {k}"))?;
    Ok(net.cpu_policy()?)
}

/// `fx-train sweep` (see the module docs).
pub fn run(args: &SweepArgs) -> Result<()> {
    let mut spec = SweepConfig::from_file(&args.config)?;
    if let Some(n) = args.trials {
        spec.trials = Some(n);
    }
    if let Some(s) = args.steps {
        spec.run.insert("steps".into(), toml::Value::Integer(s.try_into().context("--steps is too large")?));
    }
    if let Some(d) = &args.device {
        spec.run.insert("device".into(), toml::Value::String(d.clone()));
    }
    let space: Vec<(String, Dim)> = spec.space.clone().into_iter().collect();
    let points = space::sample(&space, spec.sampler, spec.trials, spec.seed)?;
    if points.is_empty() {
        bail!("the sweep has no trials");
    }
    let mut cfgs = trial_configs(&spec, &points)?;
    let base = RunConfig::from_toml_str(&toml::to_string(&spec.run)?, "the sweep's [run]")?.resolve()?;
    if base.model != ModelChoice::Dqn {
        bail!(
            "sweeps train DQN populations so far; model = {:?} is not supported by `fx-train sweep` yet",
            base.model.as_str()
        );
    }
    // Every trial sees the same market: the data follow the base config's seed, whatever a
    // trial's seed (which moves weights and environment draws).
    for c in &mut cfgs {
        c.data_seed = Some(base.synthetic.seed);
        c.synthetic.seed = base.synthetic.seed;
        c.data.clone_from(&base.data);
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let _lock = crate::run_dir::lock_folder(&args.out)?;
    crate::run_dir::write_atomic(&args.out.join("sweep.toml"), toml::to_string(&spec)?.as_bytes())?;
    let rows_path = args.out.join("trials.jsonl");
    let rows = match read_rows(&rows_path)? {
        Some(rows) if rows.len() == cfgs.len() => {
            println!(
                "sweep {}: all {} trials done already; leaderboard from trials.jsonl",
                args.out.display(),
                rows.len()
            );
            rows
        }
        _ => {
            let (rows, summary) = train_population(&base, &cfgs, &points, &args.out)?;
            write_rows(&args.out, &rows)?;
            crate::run_dir::write_atomic(
                &args.out.join("population.json"),
                serde_json::to_string_pretty(&summary)?.as_bytes(),
            )?;
            rows
        }
    };
    let board = leaderboard(&rows);
    print_board(&board, &rows, &args.out);
    let mut best = Vec::new();
    for (rank, &i) in board.iter().take(spec.best).enumerate() {
        let mut cfg = cfgs[i].clone();
        cfg.out = args.out.join(format!("best-{}", rank + 1));
        let resume = cfg.out.join("config.toml").exists();
        if !(resume && cfg.out.join("report.json").exists()) {
            println!("training trial {i} (rank {}) as an ordinary run in {}", rank + 1, cfg.out.display());
            let outcome = crate::lifecycle::run(
                cfg.clone(),
                crate::lifecycle::TrainOptions { resume, quiet: true, steps: None },
            )?;
            if matches!(outcome, crate::lifecycle::Outcome::Interrupted) {
                bail!("interrupted while training the best trials; run the same sweep again to finish them");
            }
        }
        best.push(json!({"rank": rank + 1, "trial": i, "run": cfg.out, "val_sharpe": rows[i].val_sharpe}));
    }
    let doc = json!({
        "trials_tried": rows.len(),
        "sampler": spec.sampler,
        "seed": spec.seed,
        "objective": "val_sharpe (greedy policy, validation split)",
        "test_split": format!("scored only in the best {} run folder(s)", best.len()),
        "leaderboard": board.iter().map(|&i| json!({"trial": i, "val_sharpe": rows[i].val_sharpe, "params": rows[i].params})).collect::<Vec<_>>(),
        "best": best,
    });
    crate::run_dir::write_atomic(&args.out.join("sweep.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    Ok(())
}

/// Trains every trial as one population on the base config's training split, then scores each
/// member's greedy policy on the validation split.
fn train_population(
    base: &RunConfig,
    cfgs: &[RunConfig],
    points: &[space::Point],
    out: &Path,
) -> Result<(Vec<TrialRow>, serde_json::Value)> {
    let device = crate::run_start::device_for(base)?;
    let data = Dataset::load(base, None)?;
    let members: Vec<DqnConfig> = cfgs.iter().map(|c| c.dqn.clone()).collect();
    let mut pop = DqnPopulation::new(members, &device).context("building the sweep's population")?;
    let train_rows = data.env_data(data.splits.train.clone())?;
    let mut envs: Vec<TrainEnv> =
        cfgs.iter().map(|c| TrainEnv::new(train_rows.clone(), c.env.clone(), &device)).collect::<Result<_>>()?;
    let n = cfgs.len();
    println!(
        "sweep: {n} DQN trials as one population on {}, {} env steps x {} accounts each",
        if device.is_cuda() { "cuda" } else { "cpu" },
        base.steps,
        envs[0].num_envs()
    );
    let t0 = Instant::now();
    let mut samples = 0u64;
    for step in 1..=base.steps {
        let read = step % base.log_every == 0 || step == base.steps;
        let mut refs: Vec<&mut dyn VecEnv> = envs.iter_mut().map(|e| e.as_vec_env()).collect();
        let st = pop.step(&mut refs, read)?;
        samples += (st.updates.len() as u64 + u64::from(st.updates_queued)) * (n * base.dqn.batch_size) as u64;
        if read {
            let r = st.mean_reward.as_deref().unwrap_or_default();
            let mean = r.iter().sum::<f64>() / r.len().max(1) as f64;
            println!("sweep: env step {step}/{}: mean reward over trials {mean:.3e}", base.steps);
        }
    }
    device.synchronize()?;
    let train_s = t0.elapsed().as_secs_f64();
    let (applied, skipped) = pop.counters()?;
    // The objective: each member's greedy policy on the validation split (the test split is
    // left to the best trials' run folders).
    let valid = data.env_data(data.splits.valid.clone())?;
    let mut rows = Vec::with_capacity(n);
    let weights = out.join("weights");
    std::fs::create_dir_all(&weights).with_context(|| format!("creating {}", weights.display()))?;
    for k in 0..n {
        // Each trial's final online weights (spec names, the `train` layout's `online.*` tensors).
        pop.online().member(k)?.save(&weights.join(format!("trial-{k}.safetensors")))?;
        let mut policy = member_policy(&pop, k)?;
        let positions = fx_models::replay_policy(&valid, base.env.episode_len, |obs| {
            policy.act(obs).map_err(|e| fx_models::Error::Config { context: "sweep backtest", message: e.to_string() })
        })?;
        let bt = fx_models::evaluate_positions(&positions, valid.close(), base.env.cost, data.periods_per_year)?;
        let s = &bt.stats;
        let ok = s.sharpe.is_finite() && applied[k] > 0;
        rows.push(TrialRow {
            trial: k,
            params: points[k].iter().map(|(key, v)| (key.clone(), toml_to_json(v))).collect(),
            val_sharpe: s.sharpe,
            val_total_return: s.total_return,
            val_max_drawdown: s.max_drawdown,
            updates: applied[k],
            skipped_updates: skipped[k],
            status: if ok { "ok" } else { "diverged" }.into(),
        });
    }
    let summary = json!({
        "members": n,
        "device": if device.is_cuda() { "cuda" } else { "cpu" },
        "env_steps": base.steps,
        "train_seconds": train_s,
        "update_samples_per_s": samples as f64 / train_s.max(1e-9),
    });
    println!(
        "sweep: trained {n} trials in {train_s:.1} s ({:.3e} update samples/s)",
        samples as f64 / train_s.max(1e-9)
    );
    Ok((rows, summary))
}

fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// Trial indices, best validation Sharpe first (diverged trials last, then by index).
fn leaderboard(rows: &[TrialRow]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..rows.len()).collect();
    let key = |r: &TrialRow| if r.status == "ok" { r.val_sharpe } else { f64::NEG_INFINITY };
    idx.sort_by(|&a, &b| key(&rows[b]).total_cmp(&key(&rows[a])).then(a.cmp(&b)));
    idx
}

fn print_board(board: &[usize], rows: &[TrialRow], out: &Path) {
    println!("leaderboard of {} ({} trials tried; validation split):", out.display(), rows.len());
    println!("{:>4}  {:>5}  {:>10}  {:>10}  {:>8}  params", "rank", "trial", "val sharpe", "val return", "status");
    for (rank, &i) in board.iter().take(10).enumerate() {
        let r = &rows[i];
        let params: Vec<String> = r.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:>4}  {:>5}  {:>10.3}  {:>10.4}  {:>8}  {}",
            rank + 1,
            i,
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
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
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
    csv.push_str(",val_sharpe,val_total_return,val_max_drawdown,updates,skipped_updates,status\n");
    for r in rows {
        csv.push_str(&r.trial.to_string());
        for k in &keys {
            csv.push(',');
            csv.push_str(&r.params[*k].to_string().replace(',', ";"));
        }
        csv.push_str(&format!(
            ",{},{},{},{},{},{}\n",
            r.val_sharpe, r.val_total_return, r.val_max_drawdown, r.updates, r.skipped_updates, r.status
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
        let spec =
            SweepConfig { trials: Some(1), seed: 0, sampler: Sampler::Random, best: 1, run: t, space: BTreeMap::new() };
        let cfgs = trial_configs(&spec, &[vec![("dqn.gama".into(), toml::Value::Float(0.9))]]);
        let e = format!("{:#}", cfgs.unwrap_err());
        assert!(e.contains("sweep trial 0") && e.contains("gama"), "{e}");
        let ok = trial_configs(&spec, &[vec![("dqn.gamma".into(), toml::Value::Float(0.9))]]).unwrap();
        assert_eq!((ok[0].dqn.gamma, ok[0].dqn.optimizer.lr, ok[0].steps), (0.9, 3e-4, 10));
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
        };
        let rows = vec![row(0, 0.5, "ok"), row(1, f64::NAN, "diverged"), row(2, 1.5, "ok"), row(3, 0.5, "ok")];
        assert_eq!(leaderboard(&rows), [2, 0, 3, 1]);
    }
}
