//! Walk-forward folds and seeds (`fx-train train --folds K --seeds N`, every model): the
//! evidence behind a Sharpe ratio rather than one number.
//!
//! The study folder holds the study's `config.toml` and one ordinary run folder per (fold,
//! seed), `fold{f}-seed{s}`, each trained on its fold's training span (its `rows`) with seed
//! `seed + s` on one market (`data_seed`), and backtested on its fold's test span. Spans
//! come from [`fx_data::WalkForwardConfig`] with a purge of at least the features' longest
//! look-back plus the horizon (the RL reward's one bar, the TFT's `H`, MAMBA-2's one bar:
//! [`min_purge`]); without `--folds` there is one fold, the config's split. Validation spans are the folds' model-selection rows (a sweep's
//! objective); a run here is scored on its test span only.
//!
//! A forecaster's (TFT, MAMBA-2) statistics are those of its report's sign strategy (long /
//! short on the sign of each one-bar forecast, `seq_run::SIGN_RULE`), beside its forecast
//! metrics per run and per fold (directional accuracy, MSE against the zero forecast, the
//! share of runs beating both naive forecasts); `--warm-start` starts a fold from the
//! previous fold's best-validation weights.
//!
//! On a panel (`--data` a folder of bar files, a long-format CSV or a panel file) a run's
//! statistics are its equal-weight portfolio's, and `study.json` adds each instrument's
//! mean ± sd Sharpe over the runs beside its buy-and-hold's (`per_instrument`).
//!
//! `study.json` gives each run's statistics, each fold's mean ± sd, over all runs the mean,
//! sd and a bootstrap 95 % interval of the Sharpe ratio and the shares that beat
//! buy-and-hold and random; per seed, the out-of-sample returns of its folds concatenated
//! (`oos_equity.png`), their probabilistic Sharpe ratio, the deflated Sharpe ratio of the
//! best seed counting every trial tried (the seeds plus `prior_trials`, e.g. a sweep's),
//! and the probability of backtest overfitting (CSCV) of choosing the best seed.
//!
//! A killed study resumes with `--resume`: finished runs (their `report.json`) are kept,
//! the interrupted one continues from its checkpoint, the rest start; the statistics are
//! recomputed from the run folders, so a resumed study writes what an uninterrupted one
//! does.
//!
//! `--population` (DQN, PPO) trains the study's unfinished runs together as one population
//! ([`train_as_population`]), a member per (fold, seed) with its fold's training span and
//! normalisers, its own accounts, replay or rollout and seed; member k is run k trained
//! alone (on the CPU the same weights and backtests), so `study.json` is the same. A
//! member's folder holds what the statistics read (`config.toml`, `report.json`,
//! `backtest.csv`, the plots) and its final network (`weights.safetensors`, which `eval`
//! rescores), not a checkpoint of its own: the populations train in waves the device holds,
//! and the wave in flight is checkpointed in `waves/` (the population's state, every
//! member's environments and the env steps taken) when a signal stops it and every 10
//! minutes, so `--resume` goes on from there. The data is read once ([`Source`]), and the
//! folds' training series are views of one copy of its rows (`fx_kernels::EnvData::view`,
//! [`SharedRows`]), each normalised as its rows are observed: a GPU holds the data once
//! for every fold and member.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fx_data::{Fold, Splits};
use fx_models::significance::{self, Interval};
use plotters::style::RGBColor;
use serde::Serialize;
use serde_json::{json, Value};

use crate::config::{ModelChoice, RunConfig};
use crate::dataset::{Dataset, SharedRows, Source};
use crate::lifecycle::{Outcome, TrainOptions};
use crate::run_dir::{write_atomic, RunDir};

/// Whether `cfg` asks for a study rather than one run.
pub fn is_study(cfg: &RunConfig) -> bool {
    cfg.walk_forward.is_some() || cfg.seeds > 1
}

/// The smallest purge between spans: the rows a feature row's inputs reach back (the
/// longest feature look-back) plus the horizon of the run's targets (the RL reward's and
/// MAMBA-2's one bar; the TFT's `H` bars).
pub fn min_purge(cfg: &RunConfig) -> usize {
    let horizon = match cfg.model {
        ModelChoice::Tft => cfg.tft.h,
        ModelChoice::Dqn | ModelChoice::Ppo | ModelChoice::Mamba2 => 1,
    };
    fx_data::features::WARMUP + horizon
}

/// One run of the study.
#[derive(Debug, Clone, Serialize)]
struct RunRow {
    fold: usize,
    seed: u64,
    run: PathBuf,
    test_rows: std::ops::Range<usize>,
    sharpe: f64,
    total_return: f64,
    max_drawdown: f64,
    buy_and_hold_sharpe: f64,
    buy_and_hold_return: f64,
    random_return: f64,
    beat_buy_and_hold: bool,
    beat_random: bool,
    /// Probability that the run's true Sharpe ratio on its test span is above 0.
    psr: Option<f64>,
    /// A forecaster's forecast metrics on its test span.
    #[serde(skip_serializing_if = "Option::is_none")]
    forecast: Option<ForecastRow>,
}

/// A forecaster run's forecast quality (its report's `point`, `forecast`, `beats_naive`).
#[derive(Debug, Clone, Serialize)]
struct ForecastRow {
    directional_accuracy: f64,
    rank_correlation: f64,
    /// MSEs of the model's, the zero and the last-value forecasts (target units).
    mse_model: f64,
    mse_zero: f64,
    mse_last: f64,
    beats_naive: bool,
}

impl ForecastRow {
    fn read(rep: &Value, path: &Path) -> Result<Self> {
        let num = |v: &Value, key: &str| v.as_f64().with_context(|| format!("{}: no {key}", path.display()));
        Ok(Self {
            directional_accuracy: num(&rep["forecast"]["directional_accuracy"], "forecast.directional_accuracy")?,
            rank_correlation: num(&rep["forecast"]["rank_correlation"], "forecast.rank_correlation")?,
            mse_model: num(&rep["point"]["mse_model"], "point.mse_model")?,
            mse_zero: num(&rep["point"]["mse_zero"], "point.mse_zero")?,
            mse_last: num(&rep["point"]["mse_last"], "point.mse_last")?,
            beats_naive: rep["beats_naive"].as_bool().with_context(|| format!("{}: no beats_naive", path.display()))?,
        })
    }
}

/// `fx-train train` with folds or seeds.
pub fn run(cfg: RunConfig, opts: TrainOptions) -> Result<Outcome> {
    let cfg = if opts.resume {
        let saved = RunConfig::from_toml_file(&cfg.out.join("config.toml"))?;
        RunConfig { steps: opts.steps.unwrap_or(saved.steps), ..saved }
    } else {
        cfg
    };
    if cfg.seeds == 0 {
        bail!("seeds must be at least 1");
    }
    // Everything that can refuse the study does so before its folder exists.
    let resolved = cfg.clone().resolve()?;
    let src = Source::open(&resolved)?;
    let data = Dataset::of_source(&resolved, &src, None)?;
    let rows = data.rows();
    let folds: Vec<Fold> = match &cfg.walk_forward {
        Some(wf) => wf
            .folds(rows, min_purge(&cfg))
            .with_context(|| format!("--folds {} of {} ({rows} rows)", wf.folds, data.source))?,
        None => {
            let s = &data.splits;
            vec![Fold { train: s.train.clone(), valid: s.valid.clone(), test: s.test.clone() }]
        }
    };
    if cfg.model.is_sequence() {
        // Each fold's spans must hold a window: refused here, not after the first folds.
        let len = crate::seq_run::window_len(&resolved)?;
        for (f, fold) in folds.iter().enumerate() {
            for (name, r) in [("training", &fold.train), ("validation", &fold.valid), ("test", &fold.test)] {
                if r.len() < len {
                    bail!(
                        "--folds {}: fold {f}'s {name} span has {} rows, a {} window needs {len} (fewer folds, more data or a shorter window)",
                        folds.len(),
                        r.len(),
                        cfg.model.as_str()
                    );
                }
            }
        }
    }
    let mut dir = RunDir::open(&cfg.out, opts.resume)?;
    write_atomic(&dir.path("config.toml"), cfg.to_toml()?.as_bytes())?;
    dir.mark_started();
    let n_runs = folds.len() * cfg.seeds;
    println!(
        "study of {}: {} fold(s) x {} seed(s) = {n_runs} {} runs on {}",
        dir.root().display(),
        folds.len(),
        cfg.seeds,
        cfg.model.as_str(),
        data.source
    );
    if cfg.population && train_as_population(&cfg, &src, &folds, opts.steps)? == Outcome::Interrupted {
        println!("study interrupted; continue with `fx-train train --resume --out {}`", dir.root().display());
        return Ok(Outcome::Interrupted);
    }
    for (f, fold) in folds.iter().enumerate() {
        for s in 0..cfg.seeds {
            let mut sub = member_config(&cfg, fold, f, s as u64);
            if sub.out.join("report.json").exists() {
                continue;
            }
            if cfg.warm_start && f > 0 {
                // The previous fold of this seed has finished (folds run in order): its last
                // checkpoint is its final weights.
                let prev = member_config(&cfg, &folds[f - 1], f - 1, s as u64).out;
                let ckpt = RunDir::existing(&prev)?
                    .latest_checkpoint()?
                    .with_context(|| format!("warm start of fold {f}: {} has no checkpoint", prev.display()))?;
                sub.init_from = Some(ckpt.trainer);
            }
            let resume = sub.out.join("config.toml").exists();
            println!(
                "fold {}/{} seed {}: train rows {:?}, test rows {:?}{}{}",
                f + 1,
                folds.len(),
                sub.seed,
                fold.train,
                fold.test,
                if sub.init_from.is_some() { " (warm start from the previous fold)" } else { "" },
                if resume { " (resumed)" } else { "" }
            );
            let outcome = crate::lifecycle::run(
                sub,
                TrainOptions {
                    resume,
                    restart: opts.restart && resume,
                    quiet: true,
                    steps: opts.steps,
                    pause_at: None,
                    inner: true,
                },
            )?;
            if outcome == Outcome::Interrupted {
                println!("study interrupted; continue with `fx-train train --resume --out {}`", dir.root().display());
                return Ok(Outcome::Interrupted);
            }
        }
    }
    let doc = summarise(&cfg, &folds, &data.source, &dir)?;
    write_atomic(&dir.path("study.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    print_summary(&doc, dir.root());
    Ok(Outcome::Finished)
}

/// The config of fold `f`, seed offset `s`: an ordinary run over the fold's spans.
fn member_config(cfg: &RunConfig, fold: &Fold, f: usize, s: u64) -> RunConfig {
    let mut sub = cfg.clone();
    sub.walk_forward = None;
    sub.warm_start = false;
    sub.population = false;
    sub.seeds = 1;
    sub.rows = Some(Splits { train: fold.train.clone(), valid: fold.valid.clone(), test: fold.test.clone() });
    sub.seed = cfg.seed + s;
    sub.data_seed = Some(cfg.data_seed.unwrap_or(cfg.seed));
    sub.out = cfg.out.join(format!("fold{f}-seed{s}"));
    sub
}

/// The file a population member's run folder keeps its final network in (spec names).
pub const MEMBER_WEIGHTS: &str = "weights.safetensors";

/// Trains the study's runs without a `report.json` as DQN or PPO populations (see the module
/// docs), in waves as large as the device holds (`fx_hw::HardwareBudget::population_size`
/// from a member's estimated memory, or `FX_POPULATION`), and writes each member's run
/// folder as its wave ends. A signal stops the wave in flight between env steps (DQN) or
/// iterations (PPO); the finished waves' runs are kept.
fn train_as_population(
    cfg: &RunConfig,
    src: &std::sync::Arc<Source>,
    folds: &[Fold],
    steps: Option<u64>,
) -> Result<Outcome> {
    let mut runs: Vec<(RunConfig, usize)> = Vec::new();
    for (f, fold) in folds.iter().enumerate() {
        for s in 0..cfg.seeds {
            let mut sub = member_config(cfg, fold, f, s as u64);
            if let Some(n) = steps {
                sub.steps = n;
            }
            if !sub.out.join("report.json").exists() {
                runs.push((sub.resolve()?, f));
            }
        }
    }
    let Some((first, _)) = runs.first() else {
        crate::population::remove_waves(&cfg.out)?;
        return Ok(Outcome::Finished);
    };
    let device = crate::run_start::device_for(first)?;
    // One dataset per fold (its spans and normalisers, fitted on its training rows); the
    // folds' training series are views of one copy of the rows (normalised as they are
    // observed), shared by every member: a GPU holds the data once, not once per fold.
    // The data is read once: every fold's dataset is made from the study's opened source
    // (its runs name the same data).
    let mut loaded: Vec<Option<(Dataset, usize)>> = folds.iter().map(|_| None).collect();
    for (c, f) in &runs {
        if loaded[*f].is_none() {
            loaded[*f] = Some((Dataset::of_source(c, src, None)?, c.env.episode_len + 1));
        }
    }
    let shared = SharedRows::of(&loaded.iter().flatten().map(|(d, _)| d).collect::<Vec<_>>())?;
    let mut data: Vec<Option<(Dataset, std::sync::Arc<fx_kernels::EnvData>)>> = Vec::with_capacity(folds.len());
    for fold in loaded {
        data.push(match fold {
            Some((d, min_rows)) => {
                let view = d.env_view(&shared, d.splits.train.clone(), min_rows)?;
                Some((d, view))
            }
            None => None,
        });
    }
    // What the folds' own copies held: their segments' rows.
    let per_fold: usize = data.iter().flatten().map(|(_, v)| v.segments().iter().map(|s| s.len()).sum::<usize>()).sum();
    let mib = |rows: usize| (rows * (fx_kernels::N_MARKET * 4 + 8)) as f64 / (1 << 20) as f64;
    println!(
        "the {} folds' training series: views of one copy of {} rows ({:.1} MiB; a copy per fold: {per_fold} rows, {:.1} MiB), each fold normalised as its rows are observed",
        data.iter().flatten().count(),
        shared.rows.len(),
        mib(shared.rows.len()),
        mib(per_fold)
    );
    let size = crate::population::wave_size(first, None, runs.len())?;
    println!(
        "population of {} runs on {} in waves of at most {} ({}): every unfinished (fold, seed) trained together",
        runs.len(),
        if device.is_cuda() { "cuda" } else { "cpu" },
        size.value,
        size.source
    );
    crate::lifecycle::install_signal_handler();
    for wave in runs.chunks(size.value) {
        if train_wave(cfg.model, wave, &data, &device, &cfg.out)? == Outcome::Interrupted {
            return Ok(Outcome::Interrupted);
        }
    }
    crate::population::remove_waves(&cfg.out)?;
    Ok(Outcome::Finished)
}

/// Where a study's population wave stands (its checkpoint's progress): the wave's runs,
/// their length and the env steps taken.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct StudyWave {
    runs: Vec<PathBuf>,
    steps: u64,
    env_steps: u64,
}

/// Minutes of a study wave's training between its checkpoints (and one when stopped).
const WAVE_CHECKPOINT_MINUTES: u64 = 10;

/// One wave of [`train_as_population`]: its runs `(config, fold)` as one population over
/// `data[fold]`, then each run's folder. Stopped by a signal, the wave is checkpointed in
/// `root/waves/` (and every [`WAVE_CHECKPOINT_MINUTES`] while it trains), and `--resume`
/// goes on from there; the checkpoint is removed once the runs' folders are written.
fn train_wave(
    model: ModelChoice,
    runs: &[(RunConfig, usize)],
    data: &[Option<(Dataset, std::sync::Arc<fx_kernels::EnvData>)>],
    device: &candle_core::Device,
    root: &Path,
) -> Result<Outcome> {
    let fold_data = |f: usize| data[f].as_ref().context("a fold's data");
    let mut envs = Vec::with_capacity(runs.len());
    for (c, f) in runs {
        envs.push(crate::train_env::TrainEnv::new(fold_data(*f)?.1.clone(), c.env.clone(), device)?);
    }
    let first_name = runs[0].0.out.file_name().map_or("wave".into(), |n| n.to_string_lossy().into_owned());
    let ckpt = root.join("waves").join(format!("wave-{first_name}.safetensors"));
    let mut w =
        StudyWave { runs: runs.iter().map(|(c, _)| c.out.clone()).collect(), steps: runs[0].0.steps, env_steps: 0 };
    let resumed = match crate::population::read_wave::<StudyWave>(&ckpt)? {
        Some((saved, states)) if saved.runs == w.runs && saved.steps == w.steps => {
            println!("population: goes on from env step {} ({})", saved.env_steps, ckpt.display());
            let keep: Vec<usize> = (0..runs.len()).collect();
            envs = crate::population::restore_wave_envs(envs, &keep, &states)?;
            w = saved;
            true
        }
        Some(_) => {
            println!("population: {} is another wave's checkpoint: this wave trains from its start", ckpt.display());
            false
        }
        None => false,
    };
    let every = std::time::Duration::from_secs(60 * WAVE_CHECKPOINT_MINUTES);
    let mut ck = crate::population::WaveCheckpoint::new(ckpt.clone(), Some(every), "population".into());
    // The members' folders first (a folder a stopped population left holds its config).
    let mut dirs = Vec::with_capacity(runs.len());
    for (c, _) in runs {
        let mut dir = RunDir::open(&c.out, c.out.join("config.toml").exists())?;
        write_atomic(&dir.path("config.toml"), c.to_toml()?.as_bytes())?;
        dir.mark_started();
        dirs.push(dir);
    }
    let (n, first) = (runs.len(), &runs[0].0);
    let t0 = std::time::Instant::now();
    // Each member's final network into its folder (spec names), as `eval` reads it back.
    let env_steps = match model {
        ModelChoice::Dqn => {
            let mut pop = if resumed {
                fx_models::DqnPopulation::load_state(&ckpt, device).with_context(|| {
                    format!(
                        "resuming the study's population from {} (move it away to train the wave again)",
                        ckpt.display()
                    )
                })?
            } else {
                let members = runs.iter().map(|(c, _)| c.dqn.clone()).collect();
                fx_models::DqnPopulation::new(members, device).context("building the study's population")?
            };
            for step in w.env_steps + 1..=first.steps {
                let stopping = crate::lifecycle::interrupted();
                if ck.before_step(stopping, w.env_steps, device, || pop.snapshot(), &envs, &w)? {
                    return Ok(Outcome::Interrupted);
                }
                pop.step(&mut refs(&mut envs), step == first.steps)?;
                w.env_steps = step;
            }
            for (k, dir) in dirs.iter().enumerate() {
                crate::population::dqn_member_net(&pop, k)?.params().save(&dir.path(MEMBER_WEIGHTS))?;
            }
            first.steps
        }
        ModelChoice::Ppo => {
            let mut pop = if resumed {
                fx_models::PpoPopulation::load_state(&ckpt, device).with_context(|| {
                    format!(
                        "resuming the study's population from {} (move it away to train the wave again)",
                        ckpt.display()
                    )
                })?
            } else {
                let members = runs.iter().map(|(c, _)| c.ppo.clone()).collect();
                fx_models::PpoPopulation::new(members, first.env.num_envs, device)
                    .context("building the study's population")?
            };
            while w.env_steps < first.steps {
                let stopping = crate::lifecycle::interrupted();
                if ck.before_step(stopping, w.env_steps, device, || pop.snapshot(), &envs, &w)? {
                    return Ok(Outcome::Interrupted);
                }
                w.env_steps = pop.iterate(&mut refs(&mut envs))?[0].env_steps;
            }
            let env_steps = w.env_steps;
            for (k, dir) in dirs.iter().enumerate() {
                crate::population::ppo_member_net(&pop, k)?.params().save(&dir.path(MEMBER_WEIGHTS))?;
            }
            env_steps
        }
        other => bail!("a {} study does not train as a population", other.as_str()),
    };
    device.synchronize()?;
    println!("population: {n} runs trained in {:.1} s", t0.elapsed().as_secs_f64());
    // Scoring is host work, each member's own (its saved network on the CPU, its backtests,
    // its folder): spread over the host's cores, or it outlasts the population's training.
    let jobs: Vec<_> = runs.iter().zip(&dirs).collect();
    let scored = fx_hw::par_map(&jobs, |((c, f), dir)| -> Result<()> {
        let d = &fold_data(*f)?.0;
        // The saved network's greedy actions: what `eval` of the member scores too.
        let greedy = crate::population::saved_member_greedy(c, &dir.path(MEMBER_WEIGHTS))?;
        let rep = crate::report::evaluate_policy(c, d, env_steps, |obs| greedy(obs))?;
        // Last: a run with a report is finished.
        crate::report::write(dir, "report.json", c, d, &rep, None, true)
    })
    .context("scoring the study's members")?;
    scored.into_iter().collect::<Result<Vec<()>>>()?;
    crate::population::remove_wave(&ckpt)?;
    Ok(Outcome::Finished)
}

/// The members' environments as the populations step them.
fn refs(envs: &mut [crate::train_env::TrainEnv]) -> Vec<&mut dyn fx_kernels::VecEnv> {
    envs.iter_mut().map(|e| e.as_vec_env()).collect()
}

fn read_json(path: &Path) -> Result<Value> {
    let text = fx_data::files::read_regular_to_string(path, fx_data::files::MAX_TEXT_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn stat(doc: &Value, path: &Path, who: &str, key: &str) -> Result<f64> {
    doc[who]["stats"][key].as_f64().with_context(|| format!("{}: no {who}.stats.{key}", path.display()))
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let sd = if xs.len() > 1 { (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt() } else { 0.0 };
    (mean, sd)
}

/// The study's statistics from its run folders (see the module docs).
fn summarise(cfg: &RunConfig, folds: &[Fold], source: &str, dir: &RunDir) -> Result<Value> {
    let mut runs = Vec::new();
    // Per seed: the test spans' log returns, fold after fold.
    let mut oos: Vec<Vec<f64>> = vec![Vec::new(); cfg.seeds];
    let mut periods_per_year = 0.0;
    // A panel's instruments: (name, agent Sharpes, buy-and-hold Sharpes), over the runs.
    let mut instruments: Vec<(String, Vec<f64>, Vec<f64>)> = Vec::new();
    for (f, fold) in folds.iter().enumerate() {
        for (s, seed_oos) in oos.iter_mut().enumerate() {
            let run = member_config(cfg, fold, f, s as u64).out;
            let path = run.join("report.json");
            let rep = read_json(&path)?;
            periods_per_year = rep["periods_per_year"].as_f64().context("report.json: no periods_per_year")?;
            for i in rep["instruments"].as_array().into_iter().flatten() {
                let name =
                    i["name"].as_str().with_context(|| format!("{}: an instrument without a name", path.display()))?;
                let (a, b) = (i["agent"]["sharpe"].as_f64(), i["buy_and_hold"]["sharpe"].as_f64());
                let (Some(a), Some(b)) = (a, b) else {
                    bail!("{}: instrument {name} has no agent and buy-and-hold Sharpe ratios", path.display());
                };
                match instruments.iter_mut().find(|(n, ..)| n == name) {
                    Some((_, xs, ys)) => {
                        xs.push(a);
                        ys.push(b);
                    }
                    None => instruments.push((name.to_string(), vec![a], vec![b])),
                }
            }
            let returns = crate::report::read_agent_returns(&run.join("backtest.csv"))?;
            seed_oos.extend_from_slice(&returns);
            let total = stat(&rep, &path, "agent", "total_return")?;
            let bh = stat(&rep, &path, "buy_and_hold", "total_return")?;
            let random = stat(&rep, &path, "random", "total_return")?;
            runs.push(RunRow {
                fold: f,
                seed: cfg.seed + s as u64,
                run,
                test_rows: fold.test.clone(),
                sharpe: stat(&rep, &path, "agent", "sharpe")?,
                total_return: total,
                max_drawdown: stat(&rep, &path, "agent", "max_drawdown")?,
                buy_and_hold_sharpe: stat(&rep, &path, "buy_and_hold", "sharpe")?,
                buy_and_hold_return: bh,
                random_return: random,
                beat_buy_and_hold: total > bh,
                beat_random: total > random,
                // The run's report computed it from the same returns.
                psr: rep["agent_psr"].as_f64(),
                forecast: if cfg.model.is_sequence() { Some(ForecastRow::read(&rep, &path)?) } else { None },
            });
        }
    }
    let ann = periods_per_year.sqrt();
    let sharpes: Vec<f64> = runs.iter().map(|r| r.sharpe).collect();
    let (mean, sd) = mean_sd(&sharpes);
    let ci: Interval = significance::bootstrap_mean_interval(&sharpes, 0.95, 10_000, cfg.seed)?;
    let share = |p: fn(&RunRow) -> bool| runs.iter().filter(|r| p(r)).count() as f64 / runs.len() as f64;
    let per_fold: Vec<Value> = folds
        .iter()
        .enumerate()
        .map(|(f, fold)| {
            let xs: Vec<f64> = runs.iter().filter(|r| r.fold == f).map(|r| r.sharpe).collect();
            let (m, s) = mean_sd(&xs);
            let bh = runs.iter().find(|r| r.fold == f).map_or(f64::NAN, |r| r.buy_and_hold_sharpe);
            let mut row = json!({"fold": f, "train": fold.train, "valid": fold.valid, "test": fold.test,
                   "sharpe_mean": m, "sharpe_sd": s, "buy_and_hold_sharpe": bh});
            let fc: Vec<&ForecastRow> =
                runs.iter().filter(|r| r.fold == f).filter_map(|r| r.forecast.as_ref()).collect();
            if !fc.is_empty() {
                row["forecast"] = forecast_summary(&fc);
            }
            row
        })
        .collect();
    let per_instrument: Vec<Value> = instruments
        .iter()
        .map(|(name, a, b)| {
            let (m, sd) = mean_sd(a);
            let beat = a.iter().zip(b).filter(|(x, y)| x > y).count() as f64 / a.len() as f64;
            json!({"instrument": name, "runs": a.len(), "sharpe_mean": m, "sharpe_sd": sd,
                   "buy_and_hold_sharpe_mean": mean_sd(b).0, "share_beat_buy_and_hold_sharpe": beat})
        })
        .collect();
    // Per seed, over the concatenated out-of-sample returns.
    let moments: Vec<Option<significance::ReturnMoments>> = oos.iter().map(|r| significance::moments(r).ok()).collect();
    let per_seed: Vec<Value> = moments
        .iter()
        .zip(&oos)
        .enumerate()
        .map(|(s, (m, r))| {
            json!({
                "seed": cfg.seed + s as u64,
                "periods": r.len(),
                "sharpe": m.map(|m| m.sharpe * ann),
                "total_return": r.iter().sum::<f64>().exp() - 1.0,
                "psr": m.and_then(|m| significance::probabilistic_sharpe(&m, 0.0).ok()),
            })
        })
        .collect();
    oos_equity_plot(dir, &oos)?;
    let trials = cfg.seeds + cfg.prior_trials;
    let deflated = deflate(&moments, trials, ann);
    let pbo = if cfg.seeds >= 2 {
        let t = oos[0].len();
        // As many blocks as keep each at least 16 periods, up to 8.
        let blocks = (t / 16).min(8) & !1;
        if blocks >= 2 {
            match significance::probability_of_overfitting(&oos, blocks) {
                Ok(o) => serde_json::to_value(o)?,
                Err(e) => json!({"unavailable": e.to_string()}),
            }
        } else {
            json!({"unavailable": format!("{t} out-of-sample periods are too few for 2 blocks of 16")})
        }
    } else {
        json!({"unavailable": "one seed: nothing was chosen among seeds"})
    };
    let fc: Vec<&ForecastRow> = runs.iter().filter_map(|r| r.forecast.as_ref()).collect();
    Ok(json!({
        "model": cfg.model.as_str(),
        "strategy": cfg.model.is_sequence().then_some(crate::seq_run::SIGN_RULE),
        "data_source": source,
        "folds": folds.len(),
        "window": cfg.walk_forward.as_ref().map(|w| w.window),
        "purge": cfg.walk_forward.as_ref().map(|w| w.purge.unwrap_or(min_purge(cfg))),
        "embargo": cfg.walk_forward.as_ref().map(|w| w.embargo),
        "seeds": cfg.seeds,
        "warm_start": cfg.warm_start,
        "runs": runs.len(),
        "trials_counted": trials,
        "periods_per_year": periods_per_year,
        "split": "each run is scored on its fold's test span; validation spans are for model selection",
        "summary": {
            "sharpe_mean": mean,
            "sharpe_sd": sd,
            "sharpe_mean_ci95": ci,
            "share_beat_buy_and_hold": share(|r| r.beat_buy_and_hold),
            "share_beat_random": share(|r| r.beat_random),
            "forecast": if fc.is_empty() { Value::Null } else { forecast_summary(&fc) },
        },
        "per_fold": per_fold,
        "per_instrument": if per_instrument.is_empty() { Value::Null } else { Value::Array(per_instrument) },
        "per_seed_out_of_sample": per_seed,
        "deflated_sharpe": deflated,
        "probability_of_backtest_overfitting": pbo,
        "runs_table": runs,
    }))
}

/// Forecast metrics over some forecaster runs: mean ± sd directional accuracy and rank
/// correlation, the mean MSE relative to the zero forecast's, the share beating both naive
/// forecasts.
fn forecast_summary(rows: &[&ForecastRow]) -> Value {
    let (da, da_sd) = mean_sd(&rows.iter().map(|r| r.directional_accuracy).collect::<Vec<_>>());
    let (rc, rc_sd) = mean_sd(&rows.iter().map(|r| r.rank_correlation).collect::<Vec<_>>());
    let (rel, _) = mean_sd(&rows.iter().map(|r| r.mse_model / r.mse_zero).collect::<Vec<_>>());
    let beat = rows.iter().filter(|r| r.beats_naive).count() as f64 / rows.len() as f64;
    json!({"directional_accuracy_mean": da, "directional_accuracy_sd": da_sd,
           "rank_correlation_mean": rc, "rank_correlation_sd": rc_sd,
           "mse_over_zero_forecast_mean": rel, "share_beat_naive_forecasts": beat})
}

/// `oos_equity.png`: each seed's equity over its folds' test spans, one after another.
fn oos_equity_plot(dir: &RunDir, oos: &[Vec<f64>]) -> Result<()> {
    const COLOURS: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    let curves: Vec<Vec<f64>> = oos
        .iter()
        .map(|r| {
            r.iter()
                .scan(0.0, |log_eq, x| {
                    *log_eq += x;
                    Some(f64::exp(*log_eq))
                })
                .collect()
        })
        .collect();
    let names: Vec<String> = (0..oos.len()).map(|s| format!("seed +{s}")).collect();
    let series: Vec<(&str, &[f64], RGBColor)> = names
        .iter()
        .zip(&curves)
        .enumerate()
        .map(|(i, (n, c))| (n.as_str(), c.as_slice(), COLOURS[i % COLOURS.len()]))
        .collect();
    crate::plots::curves(dir, "oos_equity.png", None, "out-of-sample equity, test spans of every fold", &series)
}

/// The deflated Sharpe ratio of the best seed's out-of-sample returns.
fn deflate(moments: &[Option<significance::ReturnMoments>], trials: usize, ann: f64) -> Value {
    let srs: Vec<f64> = moments.iter().flatten().map(|m| m.sharpe).collect();
    if srs.len() < 2 {
        return json!({"unavailable": "the Sharpe ratios' variance across trials needs 2 or more seeds"});
    }
    let (_, sd) = mean_sd(&srs);
    let (best, m) = moments
        .iter()
        .enumerate()
        .filter_map(|(i, m)| m.map(|m| (i, m)))
        .max_by(|a, b| a.1.sharpe.total_cmp(&b.1.sharpe))
        .expect("two or more");
    let var = sd * sd;
    match (significance::expected_max_sharpe(trials, var), significance::deflated_sharpe(&m, trials, var)) {
        (Ok(sr0), Ok(dsr)) => json!({
            "best_seed_index": best,
            "best_sharpe": m.sharpe * ann,
            "trials": trials,
            "expected_max_sharpe_of_unskilled_trials": sr0 * ann,
            "dsr": dsr,
        }),
        (Err(e), _) | (_, Err(e)) => json!({"unavailable": e.to_string()}),
    }
}

fn print_summary(doc: &Value, out: &Path) {
    let s = &doc["summary"];
    let f = |v: &Value| v.as_f64().map_or("n/a".to_string(), |x| format!("{x:.3}"));
    println!(
        "study of {} runs ({} fold(s) x {} seed(s)): Sharpe {} ± {} (95% CI of the mean {}..{}), beat buy-and-hold {}, beat random {}",
        doc["runs"],
        doc["folds"],
        doc["seeds"],
        f(&s["sharpe_mean"]),
        f(&s["sharpe_sd"]),
        f(&s["sharpe_mean_ci95"]["lo"]),
        f(&s["sharpe_mean_ci95"]["hi"]),
        f(&s["share_beat_buy_and_hold"]),
        f(&s["share_beat_random"]),
    );
    let fc = &s["forecast"];
    if fc.is_object() {
        println!(
            "  forecasts: directional accuracy {} ± {}, rank correlation {} ± {}, MSE / zero forecast's {}, beat both naive forecasts {} (strategy: {})",
            f(&fc["directional_accuracy_mean"]),
            f(&fc["directional_accuracy_sd"]),
            f(&fc["rank_correlation_mean"]),
            f(&fc["rank_correlation_sd"]),
            f(&fc["mse_over_zero_forecast_mean"]),
            f(&fc["share_beat_naive_forecasts"]),
            doc["strategy"].as_str().unwrap_or("")
        );
    }
    for p in doc["per_fold"].as_array().into_iter().flatten() {
        println!(
            "  fold {}: test rows {}..{}: Sharpe {} ± {} (buy-and-hold {})",
            p["fold"],
            p["test"]["start"],
            p["test"]["end"],
            f(&p["sharpe_mean"]),
            f(&p["sharpe_sd"]),
            f(&p["buy_and_hold_sharpe"])
        );
    }
    let d = &doc["deflated_sharpe"];
    if d["dsr"].is_number() {
        println!(
            "  deflated Sharpe of the best seed ({} trials counted): {} (best Sharpe {}, unskilled best expected {})",
            d["trials"],
            f(&d["dsr"]),
            f(&d["best_sharpe"]),
            f(&d["expected_max_sharpe_of_unskilled_trials"])
        );
    }
    let p = &doc["probability_of_backtest_overfitting"];
    if p["pbo"].is_number() {
        println!("  probability of backtest overfitting (choosing the best seed): {}", f(&p["pbo"]));
    }
    println!("  study.json and the run folders in {}", out.display());
}
