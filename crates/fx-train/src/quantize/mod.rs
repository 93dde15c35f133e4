//! `fx-train quantize` and `fx-train eval --int8`: the INT8 policy of a DQN/PPO run
//! (`fx-quant`), written beside the run's latest checkpoint as
//! `checkpoint-<step>.int8.safetensors`, with `quant_report.json` (agreement with F32 on
//! the test split, score errors, sizes); and its backtest beside F32's (`eval_int8.json`).
//! A TFT run's INT8 model goes the same way through `seq::quantize_tft` /
//! `eval_int8_tft` (forecast metrics instead of actions); a MAMBA-2 run's INT8 one-bar step
//! needs no file (it quantises when built) and both commands score it (`seq::int8_mamba2`).
//!
//! Calibration and agreement rows are the observations a greedy F32 replay sees (the
//! backtest's `replay_policy`): calibration on the training split, agreement on the test
//! split, so the INT8 policy is judged on the inputs it will get. The calibration rows also
//! give the file's decision margin (`fx_quant::decision_margin`), and both commands report
//! the guarded policy (`fx_quant::GuardedPolicy`: F32 on near-ties) beside the plain one.

mod seq;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fx_models::replay_policy;
use fx_quant::{CalibMethod, Decide, GuardedPolicy, Int8Policy};
use serde_json::json;

use crate::agent::Agent;
use crate::cli::{QuantMethod, QuantizeArgs};
use crate::config::{ModelChoice, RunConfig};
use crate::dataset::Dataset;
use crate::run_dir::{write_atomic, Checkpoint, RunDir};

/// What both commands load: the run's config, its latest checkpoint on the CPU, its data.
struct Loaded {
    dir: RunDir,
    cfg: RunConfig,
    checkpoint: Checkpoint,
    agent: Agent,
    data: Dataset,
}

/// A run's folder and config, for the commands to pick the model's path.
fn run_config(run: &Path) -> Result<(RunDir, RunConfig)> {
    let dir = RunDir::existing(run)?;
    let cfg = RunConfig::from_toml_file(&dir.path("config.toml"))?.resolve()?;
    if cfg.validation_only {
        // Its INT8 comparison would score the test split, which a sweep keeps for the
        // trials it chooses.
        bail!(
            "{}: a sweep's trial (scored on the validation split only); quantize its best-N run instead",
            run.display()
        );
    }
    Ok((dir, cfg))
}

fn load_run(run: &Path) -> Result<Loaded> {
    let (dir, cfg) = run_config(run)?;
    let Some(checkpoint) = dir.latest_checkpoint()? else {
        bail!("{} holds no checkpoint yet", run.display());
    };
    checkpoint.check_model(cfg.model, "config.toml says")?;
    let data = Dataset::load(&cfg, Some(checkpoint.run.normalizers()?))?;
    checkpoint.check_source(&data.source, "config.toml now names")?;
    if data.is_panel() {
        bail!(
            "{}: a run on a panel ({}) is not quantised yet (its calibration replays one instrument)",
            run.display(),
            data.source
        );
    }
    // Quantisation and INT8 decisions are CPU work, wherever the run trained.
    let agent = Agent::load(cfg.model, &checkpoint.trainer, &Device::Cpu)?;
    Ok(Loaded { dir, cfg, checkpoint, agent, data })
}

/// The INT8 file of a checkpoint: `checkpoint-<step>.int8.safetensors` beside it.
pub fn int8_path(trainer: &Path) -> PathBuf {
    let stem = trainer.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    trainer.with_file_name(format!("{stem}.int8.safetensors"))
}

/// The observations a greedy F32 replay of `rows` sees (`rows × 56`), in order.
fn replay_observations(l: &Loaded, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let Some(span) = l.data.instrument_span(0, &rows)? else {
        bail!("{}: rows {rows:?} hold fewer than 2 bars to replay", l.data.source);
    };
    let series = span.series;
    let mut policy = l.agent.cpu_policy()?;
    let mut seen = Vec::new();
    replay_policy(&series, l.cfg.env.episode_len, |obs| {
        seen.extend_from_slice(obs);
        policy.act(obs).map_err(|e| fx_models::Error::Config { context: "F32 replay", message: e.to_string() })
    })?;
    Ok(seen)
}

/// What every `quant_report.json` starts with: the model, the checkpoint and the INT8 file,
/// the source's hash and the calibration.
pub(crate) fn report_head(
    model: &str,
    checkpoint: &Path,
    int8_file: &Path,
    provenance: &fx_quant::int8_file::Provenance,
    calibration: &fx_quant::CalibInfo,
    from: &str,
) -> serde_json::Value {
    json!({
        "model": model,
        "checkpoint": checkpoint.display().to_string(),
        "int8_file": int8_file.display().to_string(),
        "source_sha256": provenance.source_sha256,
        "format": fx_quant::int8_file::FORMAT,
        "calibration": {
            "method": calibration.method,
            "percentile": calibration.percentile,
            "rows": calibration.rows,
            "from": from,
        },
    })
}

/// Adds `more`'s fields to the JSON object `doc`.
pub(crate) fn extend(doc: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(d), serde_json::Value::Object(m)) = (doc.as_object_mut(), more) {
        d.extend(m);
    }
}

/// The calibration method the flags ask for.
pub(crate) fn calib_method(args: &QuantizeArgs) -> CalibMethod {
    match args.method {
        QuantMethod::Minmax => CalibMethod::MinMax,
        QuantMethod::Percentile => CalibMethod::Percentile(args.percentile),
        QuantMethod::Dynamic => CalibMethod::Dynamic,
    }
}

pub fn run(args: &QuantizeArgs) -> Result<()> {
    if args.calib_rows == Some(0) {
        bail!("--calib-rows must be at least 1");
    }
    let (dir, cfg) = run_config(&args.checkpoint)?;
    if cfg.model.is_sequence() && !args.f32_layers.is_empty() {
        bail!("--f32-layers applies to dqn and ppo runs (not to a {} run)", cfg.model.as_str());
    }
    if cfg.model == ModelChoice::Tft {
        return seq::quantize_tft(&dir, cfg, args.calib_rows.unwrap_or(256), calib_method(args));
    }
    if cfg.model == ModelChoice::Mamba2 {
        if args.method != QuantMethod::Dynamic || args.calib_rows.is_some() {
            bail!("a mamba2 run's INT8 step takes dynamic input scales: no --method or --calib-rows");
        }
        return seq::int8_mamba2(&dir, cfg, "quant_report.json");
    }
    let l = load_run(&args.checkpoint)?;
    let float = l.agent.float_net()?;
    let width = float.state_dim();
    let train_obs = replay_observations(&l, l.data.splits.train.clone())?;
    let calib = fx_quant::calibrate::spread_rows(&train_obs, width, args.calib_rows.unwrap_or(2048));
    let method = calib_method(args);
    let keep: Vec<&str> = args.f32_layers.iter().map(String::as_str).collect();
    let mut q = fx_quant::quantize(&float, &calib, method, &keep)?;
    // The guard's margin, from the same calibration rows (fx_quant::guard).
    q.calibration.decision_margin = Some(fx_quant::decision_margin(&float, &q, &calib)?);

    if crate::lifecycle::interrupted() {
        println!("interrupted before writing the INT8 file: nothing was written");
        return Ok(());
    }
    let trainer = &l.checkpoint.trainer;
    let provenance = fx_quant::int8_file::Provenance {
        source_sha256: fx_quant::int8_file::sha256_file(trainer)?,
        source: trainer.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    };
    let out = int8_path(trainer);
    fx_quant::int8_file::save(&q, &provenance, &out)?;
    // Read back through the checked loader, as `eval --int8` and services will.
    let (q, _) = fx_quant::int8_file::load(&out, Some(&provenance.source_sha256))?;

    let test_obs = replay_observations(&l, l.data.splits.test.clone())?;
    let agree = fx_quant::reference::agreement(&float, &q, &test_obs)?;
    // The deployed path decides the same actions as the reference it is tested against.
    let mut policy = Int8Policy::new(&q)?;
    let mut f32_policy = l.agent.cpu_policy()?;
    let mut guarded = GuardedPolicy::new(&q, l.agent.cpu_policy()?)?;
    let (mut same_as_cpu_f32, mut guarded_same) = (0usize, 0usize);
    for row in test_obs.chunks_exact(width) {
        let want = Decide::act(&mut f32_policy, row)?;
        same_as_cpu_f32 += usize::from(policy.act(row)? == want);
        guarded_same += usize::from(guarded.act(row)? == want);
    }
    let guarded_agreement = guarded_same as f64 / agree.rows.max(1) as f64;
    let f32_bytes = 4 * float.num_params();
    let file_bytes = std::fs::metadata(&out).with_context(|| format!("reading {}", out.display()))?.len();
    let score = if float.kind.dueling() { "q" } else { "logit" };
    let layers: Vec<_> = q
        .layers
        .iter()
        .map(|layer| match layer {
            fx_quant::QuantLayer::Int8(x) => json!({
                "name": x.name, "dtype": "int8", "shape": [x.out, x.inp], "input_scale": x.input_scale,
                "weight_scale_max": x.weight_scale.iter().copied().fold(0.0f32, f32::max),
            }),
            fx_quant::QuantLayer::F32(x) => json!({ "name": x.name, "dtype": "f32", "shape": [x.out, x.inp] }),
        })
        .collect();
    let mut report = report_head(
        l.cfg.model.as_str(),
        trainer,
        &out,
        &provenance,
        &q.calibration,
        "greedy F32 replay of the training split",
    );
    let body = json!({
        "f32_layers": q.f32_layers(),
        "layers": layers,
        "isa": policy.isa().name(),
        "test_rows": agree.rows,
        "action_agreement": agree.fraction(),
        "action_agreement_with_cpu_f32": same_as_cpu_f32 as f64 / agree.rows.max(1) as f64,
        "decision_margin": guarded.margin(),
        "guarded_action_agreement": guarded_agreement,
        "guarded_f32_share": guarded.checked_share(),
        "score": score,
        "max_abs_score_diff": agree.max_abs_score_diff,
        "mean_abs_score_diff": agree.mean_abs_score_diff,
        "max_abs_score": agree.max_abs_score,
        "f32_bytes": f32_bytes,
        "int8_bytes": q.bytes(),
        "size_ratio": f32_bytes as f64 / q.bytes() as f64,
        "file_bytes": file_bytes,
    });
    extend(&mut report, body);
    write_atomic(&l.dir.path("quant_report.json"), serde_json::to_string_pretty(&report)?.as_bytes())?;
    println!(
        "wrote {} ({} {} layers INT8{}, calibrated on {} training-split rows, {}; {} path)",
        out.display(),
        q.layers.len() - q.f32_layers().len(),
        l.cfg.model.as_str(),
        if q.f32_layers().is_empty() { String::new() } else { format!(", {} F32", q.f32_layers().join(",")) },
        q.calibration.rows,
        method,
        policy.isa().name()
    );
    println!(
        "test split ({} rows): greedy action equal to F32 on {:.2}%, max |Δ{score}| {:.3e} (mean {:.3e}, max |{score}| {:.3}); \
         weights {:.0} KiB F32 -> {:.0} KiB INT8 ({:.2}x)",
        agree.rows,
        100.0 * agree.fraction(),
        agree.max_abs_score_diff,
        agree.mean_abs_score_diff,
        agree.max_abs_score,
        f32_bytes as f64 / 1024.0,
        q.bytes() as f64 / 1024.0,
        f32_bytes as f64 / q.bytes() as f64
    );
    println!(
        "guarded (INT8, F32 where the two best scores are within {:.3e}): greedy action equal to F32 on {:.2}%, \
         {:.2}% of decisions checked in F32",
        guarded.margin(),
        100.0 * guarded_agreement,
        100.0 * guarded.checked_share()
    );
    println!("report: {}", l.dir.path("quant_report.json").display());
    if agree.fraction() < AGREEMENT_TARGET {
        eprintln!(
            "warning: the INT8 policy decides like F32 on {:.2}% of test rows, below the {:.0}% target: \
             deploy it guarded (fx_quant::GuardedPolicy: {:.2}% here) and check `fx-train eval --int8`",
            100.0 * agree.fraction(),
            100.0 * AGREEMENT_TARGET,
            100.0 * guarded_agreement
        );
    }
    if guarded_agreement < AGREEMENT_TARGET {
        eprintln!(
            "warning: the guarded INT8 policy decides like F32 on only {:.2}% of test rows (target {:.0}%): \
             keep layers in F32 with --f32-layers",
            100.0 * guarded_agreement,
            100.0 * AGREEMENT_TARGET
        );
    }
    Ok(())
}

/// Issue 13's accuracy bars: greedy actions equal to F32's on this share of test rows, and
/// the backtest's Sharpe within this relative distance of F32's. Below them the commands
/// say so on stderr (the files are still written: the numbers are the user's to judge).
const AGREEMENT_TARGET: f64 = 0.99;
const SHARPE_REL_TARGET: f64 = 0.02;

/// `fx-train eval --int8`: the INT8 policy's backtest beside the F32 policy's.
pub fn eval_int8(run: &Path) -> Result<()> {
    let (dir, cfg) = run_config(run)?;
    if cfg.model == ModelChoice::Tft {
        return seq::eval_int8_tft(&dir, cfg);
    }
    if cfg.model == ModelChoice::Mamba2 {
        return seq::int8_mamba2(&dir, cfg, "eval_int8.json");
    }
    let l = load_run(run)?;
    let trainer = &l.checkpoint.trainer;
    let path = int8_path(trainer);
    if !path.exists() {
        bail!(
            "{} has no INT8 policy for {}: run `fx-train quantize --checkpoint {}` first",
            run.display(),
            trainer.file_name().unwrap_or_default().to_string_lossy(),
            run.display()
        );
    }
    let sha = match &l.checkpoint.run.trainer_sha256 {
        Some(s) => s.clone(),
        None => fx_quant::int8_file::sha256_file(trainer)?,
    };
    let (q, _) = fx_quant::int8_file::load(&path, Some(&sha))?;
    let mut policy = Int8Policy::new(&q)?;
    let mut f32_policy = l.agent.cpu_policy()?;
    let steps = l.agent.env_steps();
    let f32_rep = crate::report::evaluate_policy(&l.cfg, &l.data, steps, |obs| Ok(f32_policy.act(obs)?))?;
    let int8_rep = crate::report::evaluate_policy(&l.cfg, &l.data, steps, |obs| Ok(policy.act(obs)? as u32))?;
    // The guarded policy, where the file records a margin (files quantised before margins
    // do not).
    let guarded = match q.calibration.decision_margin {
        Some(_) => {
            let mut g = GuardedPolicy::new(&q, l.agent.cpu_policy()?)?;
            let rep = crate::report::evaluate_policy(&l.cfg, &l.data, steps, |obs| Ok(g.act(obs)? as u32))?;
            Some((rep, g.checked_share()))
        }
        None => None,
    };
    let (a, b) = (&f32_rep.agent, &int8_rep.agent);
    let sharpe_rel = |s: f64| {
        if a.stats.sharpe != 0.0 {
            (s - a.stats.sharpe).abs() / a.stats.sharpe.abs()
        } else {
            (s - a.stats.sharpe).abs()
        }
    };
    let same_positions =
        |p: &[i8]| a.positions.iter().zip(p).filter(|(x, y)| x == y).count() as f64 / a.positions.len().max(1) as f64;
    let same = same_positions(&b.positions);
    let (s32, s8) = (a.stats.sharpe, b.stats.sharpe);
    let rel = sharpe_rel(s8);
    let mut doc = json!({
        "model": l.cfg.model.as_str(),
        "checkpoint": trainer.display().to_string(),
        "int8_file": path.display().to_string(),
        "test_rows": f32_rep.test_rows,
        "f32": a.stats,
        "int8": b.stats,
        "sharpe_f32": s32,
        "sharpe_int8": s8,
        "sharpe_rel_diff": rel,
        "position_agreement": same,
        "buy_and_hold": f32_rep.buy_and_hold.stats,
        "flat": f32_rep.flat.stats,
    });
    if let Some((g, share)) = &guarded {
        extend(
            &mut doc,
            json!({
                "int8_guarded": g.agent.stats,
                "sharpe_int8_guarded": g.agent.stats.sharpe,
                "sharpe_rel_diff_guarded": sharpe_rel(g.agent.stats.sharpe),
                "position_agreement_guarded": same_positions(&g.agent.positions),
                "guarded_f32_share": share,
            }),
        );
    }
    write_atomic(&l.dir.path("eval_int8.json"), serde_json::to_string_pretty(&doc)?.as_bytes())?;
    println!(
        "backtest of the {} policy on the test split ({} rows), F32 and INT8 ({}):",
        l.cfg.model.as_str(),
        f32_rep.test_rows.len(),
        policy.isa().name()
    );
    println!(
        "{:<14} {:>10} {:>10} {:>7} {:>8} {:>8} {:>7} {:>8} {:>9}",
        "policy", "total", "annual", "sharpe", "sortino", "max dd", "hit", "turnover", "cost"
    );
    println!("{}", crate::report::row("F32 (CPU)", &a.stats));
    println!("{}", crate::report::row("INT8", &b.stats));
    if let Some((g, _)) = &guarded {
        println!("{}", crate::report::row("INT8 guarded", &g.agent.stats));
    }
    println!("{}", crate::report::row("buy & hold", &f32_rep.buy_and_hold.stats));
    println!(
        "Sharpe F32 {s32:.4} vs INT8 {s8:.4} ({:.2}% apart); same position on {:.2}% of bars; {}",
        100.0 * rel,
        100.0 * same,
        l.dir.path("eval_int8.json").display()
    );
    if let Some((g, share)) = &guarded {
        println!(
            "guarded INT8 (F32 on near-ties, {:.2}% of decisions): Sharpe {:.4} ({:.2}% apart); same position on {:.2}% of bars",
            100.0 * share,
            g.agent.stats.sharpe,
            100.0 * sharpe_rel(g.agent.stats.sharpe),
            100.0 * same_positions(&g.agent.positions)
        );
    }
    if let Some(rel_g) =
        guarded.as_ref().map(|(g, _)| sharpe_rel(g.agent.stats.sharpe)).filter(|r| *r > SHARPE_REL_TARGET)
    {
        eprintln!(
            "warning: the guarded INT8 policy's Sharpe differs from F32's by {:.1}% (target {:.0}%)",
            100.0 * rel_g,
            100.0 * SHARPE_REL_TARGET
        );
    }
    if rel > SHARPE_REL_TARGET {
        eprintln!(
            "warning: the INT8 policy's Sharpe is {:.1}% away from F32's (target {:.0}%): it trades differently",
            100.0 * rel,
            100.0 * SHARPE_REL_TARGET
        );
    }
    Ok(())
}
