//! The backtest report of a run: the agent's greedy policy on the test split beside
//! buy-and-hold, flat and random positions.

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fx_models::{evaluate_positions, random_positions, replay_policy, Backtest, BacktestStats};
use serde::Serialize;
use serde_json::json;

use crate::agent::Agent;
use crate::config::RunConfig;
use crate::dataset::Dataset;
use crate::rl_run::Profile;
use crate::run_dir::{write_atomic, RunDir};

#[derive(Serialize)]
pub struct Report {
    pub model: &'static str,
    pub data_source: String,
    pub test_rows: std::ops::Range<usize>,
    pub periods_per_year: f64,
    pub env_steps: u64,
    /// One instrument: its backtest; a panel: the equal-weight portfolio of the
    /// instruments' (`fx_models::equal_weight`), and so for the baselines.
    pub agent: Backtest,
    pub buy_and_hold: Backtest,
    pub flat: Backtest,
    pub random: Backtest,
    /// A panel's instruments, each backtested on its own test rows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instruments: Vec<InstrumentReport>,
    /// Panel instruments left out of the run (too few training rows) or of the test span
    /// (fewer than 2 rows there).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub excluded_instruments: Vec<String>,
    /// The calendar row each of the agent's steps starts at.
    #[serde(skip)]
    pub step_rows: Vec<usize>,
}

/// One instrument's backtest in a panel's report.
#[derive(Serialize, Clone)]
pub struct InstrumentReport {
    pub name: String,
    /// Its steps in the span.
    pub steps: usize,
    pub agent: BacktestStats,
    pub buy_and_hold: BacktestStats,
    pub flat: BacktestStats,
    pub random: BacktestStats,
}

impl Report {
    /// The agent beat flat and random by total return (what "it learned" means here).
    pub fn learned(&self) -> bool {
        let a = self.agent.stats.total_return;
        a > self.flat.stats.total_return && a > self.random.stats.total_return
    }
}

pub fn evaluate(cfg: &RunConfig, data: &Dataset, agent: &Agent, device: &Device) -> Result<Report> {
    evaluate_policy(cfg, data, agent.env_steps(), |obs| agent.greedy_action(obs, device))
}

/// The backtest of any greedy `policy` (observation → action) on the test split, beside
/// the baselines.
pub fn evaluate_policy(
    cfg: &RunConfig,
    data: &Dataset,
    env_steps: u64,
    mut policy: impl FnMut(&[f32]) -> Result<u32>,
) -> Result<Report> {
    let rows = data.splits.test.clone();
    let b = backtest_span(cfg, data, &rows, &mut policy)?;
    Ok(Report {
        model: cfg.model.as_str(),
        data_source: data.source.clone(),
        test_rows: rows,
        periods_per_year: data.periods_per_year,
        env_steps,
        agent: b.agent,
        buy_and_hold: b.buy_and_hold,
        flat: b.flat,
        random: b.random,
        instruments: b.instruments,
        excluded_instruments: b.excluded,
        step_rows: b.step_rows,
    })
}

/// A policy's backtest over a calendar span, beside the baselines: one instrument's own,
/// or a panel's equal-weight portfolio with each instrument's table.
pub struct SpanBacktest {
    pub agent: Backtest,
    pub buy_and_hold: Backtest,
    pub flat: Backtest,
    pub random: Backtest,
    pub instruments: Vec<InstrumentReport>,
    pub excluded: Vec<String>,
    pub step_rows: Vec<usize>,
}

/// Replays `policy` greedily over every instrument's rows of `span` (each as one account
/// starting flat) and backtests it and the baselines; the random baseline of instrument
/// `i` draws from seed `cfg.seed + i`.
pub fn backtest_span(
    cfg: &RunConfig,
    data: &Dataset,
    span: &std::ops::Range<usize>,
    policy: &mut dyn FnMut(&[f32]) -> Result<u32>,
) -> Result<SpanBacktest> {
    let spans = data.spans(span)?;
    let mut excluded = data.excluded.clone();
    for (i, inst) in data.instruments.iter().enumerate() {
        if !spans.iter().any(|s| s.instrument == i) {
            excluded.push(inst.name.clone());
        }
    }
    if spans.is_empty() {
        bail!("{}: no instrument has 2 rows in calendar rows {span:?}", data.source);
    }
    let mut legs = Vec::with_capacity(spans.len());
    for s in spans {
        let positions = replay_policy(&s.series, cfg.env.episode_len, |obs| {
            policy(obs).map_err(|e| fx_models::Error::Config { context: "backtest policy", message: format!("{e:#}") })
        })?;
        legs.push(Leg::new(cfg, data, s.instrument, s.steps, &positions, s.series.close())?);
    }
    combine_legs(cfg, data, span, legs, excluded)
}

/// One instrument's part of a span's backtest: the span index of the calendar row each
/// step starts at, and the agent's, buy-and-hold's, flat's and random's backtests there.
pub struct Leg {
    pub instrument: usize,
    pub steps: Vec<usize>,
    /// Agent, buy-and-hold, flat, random.
    pub parts: [Backtest; 4],
}

impl Leg {
    /// `positions[j]` held over step `j`, from `close[j]` to `close[j + 1]`; the random
    /// baseline of instrument `i` draws from seed `cfg.seed + i`.
    pub fn new(
        cfg: &RunConfig,
        data: &Dataset,
        instrument: usize,
        steps: Vec<usize>,
        positions: &[i8],
        close: &[f64],
    ) -> Result<Self> {
        let (cost, ppy, n) = (cfg.env.cost, data.periods_per_year, positions.len());
        let seed = cfg.seed.wrapping_add(instrument as u64);
        Ok(Leg {
            instrument,
            steps,
            parts: [
                evaluate_positions(positions, close, cost, ppy)?,
                evaluate_positions(&vec![1; n], close, cost, ppy)?,
                evaluate_positions(&vec![0; n], close, cost, ppy)?,
                evaluate_positions(&random_positions(n, seed), close, cost, ppy)?,
            ],
        })
    }
}

/// The span's backtest of its legs (every instrument's that traded there): one
/// instrument's own, or a panel's equal-weight portfolio with each instrument's table;
/// `excluded` names the instruments without a leg.
pub fn combine_legs(
    cfg: &RunConfig,
    data: &Dataset,
    span: &std::ops::Range<usize>,
    mut legs: Vec<Leg>,
    excluded: Vec<String>,
) -> Result<SpanBacktest> {
    let (cost, ppy) = (cfg.env.cost, data.periods_per_year);
    if !data.is_panel() {
        let leg = legs.pop().context("one instrument")?;
        let [agent, buy_and_hold, flat, random] = leg.parts;
        let step_rows = leg.steps.iter().map(|&k| span.start + k).collect();
        return Ok(SpanBacktest { agent, buy_and_hold, flat, random, instruments: Vec::new(), excluded, step_rows });
    }
    let portfolio = |k: usize| {
        let parts: Vec<(&[usize], &Backtest)> = legs.iter().map(|l| (l.steps.as_slice(), &l.parts[k])).collect();
        fx_models::equal_weight(&parts, cost, ppy)
    };
    let mut step_rows: Vec<usize> = legs.iter().flat_map(|l| l.steps.iter().map(|&k| span.start + k)).collect();
    step_rows.sort_unstable();
    step_rows.dedup();
    let instruments = legs
        .iter()
        .map(|l| InstrumentReport {
            name: data.instruments[l.instrument].name.clone(),
            steps: l.steps.len(),
            agent: l.parts[0].stats.clone(),
            buy_and_hold: l.parts[1].stats.clone(),
            flat: l.parts[2].stats.clone(),
            random: l.parts[3].stats.clone(),
        })
        .collect();
    Ok(SpanBacktest {
        agent: portfolio(0)?,
        buy_and_hold: portfolio(1)?,
        flat: portfolio(2)?,
        random: portfolio(3)?,
        instruments,
        excluded,
        step_rows,
    })
}

/// Writes the report as `name` (e.g. `report.json`) into the run folder, and the plots
/// when `plots` is set.
pub fn write(
    dir: &RunDir,
    name: &str,
    cfg: &RunConfig,
    data: &Dataset,
    rep: &Report,
    profile: Option<&Profile>,
    plots: bool,
) -> Result<()> {
    let mut doc = serde_json::to_value(rep)?;
    doc["learned"] = json!(rep.learned());
    trim_backtests(&mut doc, &rep.agent);
    doc["profile"] = serde_json::to_value(profile)?;
    write_atomic(&dir.path(name), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    if plots {
        write_backtest_csv(dir, &rep.agent, &rep.step_rows)?;
        crate::plots::write_all(dir, cfg, data, rep)?;
    }
    Ok(())
}

/// A report document's backtests as `report.json` keeps them (every run kind's, RL or
/// forecaster): `agent_psr`, the probability that the agent's true Sharpe ratio on these
/// rows is above 0 (from the returns' length, skewness and kurtosis; null when they do not
/// vary), and the `agent`, `buy_and_hold`, `flat`, `random` entries without their
/// per-step vectors (those are in `backtest.csv` and the plots; the file stays readable).
pub(crate) fn trim_backtests(doc: &mut serde_json::Value, agent: &Backtest) {
    doc["agent_psr"] = json!(fx_models::significance::moments(&agent.returns)
        .and_then(|m| fx_models::significance::probabilistic_sharpe(&m, 0.0))
        .ok());
    for k in ["agent", "buy_and_hold", "flat", "random"] {
        if let Some(o) = doc[k].as_object_mut() {
            o.remove("equity");
            o.remove("positions");
            o.remove("returns");
        }
    }
}

/// The training report's per-step backtest of the agent, beside `report.json`.
pub(crate) const BACKTEST_CSV: &str = "backtest.csv";

/// Writes `backtest.csv`: `row,position,log_return,equity`, one line per test step (`row`
/// is the calendar row the step starts at, `step_rows[i]`; a panel's portfolio has no
/// single position, its column is empty). Returns are written with Rust's shortest
/// round-trip formatting, so a reader gets the very values the statistics used.
pub(crate) fn write_backtest_csv(dir: &RunDir, agent: &Backtest, step_rows: &[usize]) -> Result<()> {
    let mut out = String::from("row,position,log_return,equity\n");
    for (i, (r, e)) in agent.returns.iter().zip(&agent.equity).enumerate() {
        let p = agent.positions.get(i).map(|p| p.to_string()).unwrap_or_default();
        out.push_str(&format!("{},{p},{r:?},{e:?}\n", step_rows[i]));
    }
    write_atomic(&dir.path(BACKTEST_CSV), out.as_bytes())
}

/// The agent's per-step log returns from a run's `backtest.csv`.
pub(crate) fn read_agent_returns(path: &std::path::Path) -> Result<Vec<f64>> {
    let text = fx_data::files::read_regular_to_string(path, u64::MAX)
        .with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    if lines.next() != Some("row,position,log_return,equity") {
        bail!("{}: line 1 is not the header row,position,log_return,equity", path.display());
    }
    lines
        .enumerate()
        .map(|(i, l)| {
            l.split(',')
                .nth(2)
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite())
                .with_context(|| format!("{}: line {}: no finite log_return in {l:?}", path.display(), i + 2))
        })
        .collect()
}

/// The backtest table: a header, then a [`row`] per named backtest.
pub(crate) fn print_table(rows: &[(&str, &Backtest)]) {
    println!(
        "{:<14} {:>10} {:>10} {:>7} {:>8} {:>8} {:>7} {:>8} {:>9}",
        "policy", "total", "annual", "sharpe", "sortino", "max dd", "hit", "turnover", "cost"
    );
    for (name, b) in rows {
        println!("{}", row(name, &b.stats));
    }
}

pub(crate) fn row(name: &str, s: &BacktestStats) -> String {
    format!(
        "{name:<14} {:>9.2}% {:>9.2}% {:>7.2} {:>8.2} {:>7.2}% {:>6.1}% {:>8.3} {:>9.5}",
        100.0 * s.total_return,
        100.0 * s.annualised_return,
        s.sharpe,
        s.sortino,
        100.0 * s.max_drawdown,
        100.0 * s.hit_rate,
        s.turnover,
        s.cost_paid
    )
}

pub fn print(rep: &Report, profile: Option<&Profile>, dir: &RunDir) {
    println!(
        "backtest of {} on the test split ({} rows {}..{} of {}; {:.0} bars/year; after {} env steps)",
        rep.model,
        rep.test_rows.len(),
        rep.test_rows.start,
        rep.test_rows.end,
        rep.data_source,
        rep.periods_per_year,
        rep.env_steps
    );
    print_table(&[
        ("agent (greedy)", &rep.agent),
        ("buy & hold", &rep.buy_and_hold),
        ("flat", &rep.flat),
        ("random", &rep.random),
    ]);
    if !rep.instruments.is_empty() {
        println!(
            "(a panel: the rows above are the equal-weight portfolio of {} instruments; agent and buy & hold per instrument:)",
            rep.instruments.len()
        );
        for i in &rep.instruments {
            println!("{}:", i.name);
            println!("{}", row("  agent", &i.agent));
            println!("{}", row("  buy & hold", &i.buy_and_hold));
        }
        if !rep.excluded_instruments.is_empty() {
            println!("left out (too few rows): {}", rep.excluded_instruments.join(", "));
        }
    }
    println!(
        "{}",
        if rep.learned() {
            "the agent beat flat and random on held-out data"
        } else {
            "the agent did NOT beat both flat and random on held-out data"
        }
    );
    if let Some(p) = profile {
        println!(
            "time: {:.1}s total = data {:.1}s + env/collect {:.1}s + updates {:.1}s + checkpoints/logs {:.1}s + eval {:.1}s + other {:.1}s",
            p.total, p.data_prep, p.env_collect, p.update, p.checkpoint_and_logging, p.evaluation, p.other
        );
        if p.checkpoint_snapshot + p.checkpoint_wait > 0.0 {
            println!(
                "checkpoints: device's queued work {:.2}s + state to host {:.2}s + waiting for the previous write {:.2}s",
                p.checkpoint_device_wait, p.checkpoint_snapshot, p.checkpoint_wait
            );
        }
        if let Some(u) = &p.update_phases {
            println!(
                "PPO updates: prepare {:.2}s + queue the epochs {:.2}s + wait for the device {:.2}s + read the rollout's statistics {:.2}s",
                u.prepare, u.launch, u.device_wait, u.finish
            );
        }
        let split = p.update_forward + p.update_backward + p.update_device_wait + p.update_optimizer;
        if split == 0.0 && p.update > 0.0 {
            // Fused steps (CPU) and captured graphs (CUDA) have no host-side phases to split.
            println!("updates: fused steps or captured graphs (no forward/backward/optimiser split on the host)");
        } else {
            println!(
                "updates: forward {:.1}s + backward {:.1}s + device wait {:.1}s + optimiser {:.1}s (this session's steps)",
                p.update_forward, p.update_backward, p.update_device_wait, p.update_optimizer
            );
        }
        if let Some(b) = p.gpu_busy_fraction {
            println!("GPU busy: {:.1}% of the training loop (driver utilisation samples)", 100.0 * b);
        } else if let Some(why) = &p.gpu_busy_unavailable {
            println!("GPU busy: not measured ({why})");
        }
    }
    println!("run folder: {}", dir.root().display());
}
