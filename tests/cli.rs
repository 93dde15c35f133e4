//! End-to-end tests of the `fx-train` binary: exit codes, one-line errors, outputs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fx_train() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fx-train"));
    // The tests must not depend on the developer's environment.
    cmd.env_remove("FX_DEVICE").env_remove("FX_PRECISION").env_remove("FX_BATCH_SIZE");
    cmd
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures")
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn hw_json_reports_a_cpu_budget_with_sources() {
    let out = fx_train().args(["hw", "--json", "--device", "cpu"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(v["device"]["value"]["kind"], "cpu");
    assert_eq!(v["device"]["source"]["kind"], "config");
    assert_eq!(v["precision"]["value"], "f32");
    assert!(v["host"]["cpu_cores"].as_u64().unwrap() >= 1);
}

#[test]
fn hw_table_shows_env_overrides_and_their_source() {
    let out = fx_train().args(["hw", "--device", "cpu"]).env("FX_BATCH_SIZE", "320").output().unwrap();
    let text = ok(&out);
    let line = text.lines().find(|l| l.starts_with("dqn batch")).expect("a dqn batch row");
    assert!(line.contains("320") && line.contains("env FX_BATCH_SIZE"), "{line}");
}

#[test]
fn bad_env_override_is_a_one_line_error() {
    let out = fx_train().args(["hw"]).env("FX_PRECISION", "int4").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("FX_PRECISION") && err.contains("int4"), "{err}");
}

#[test]
fn features_reproduces_the_fixture_and_refuses_bad_files() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("f.safetensors");
    let out = fx_train()
        .args(["features", "--input"])
        .arg(fixtures().join("features_small.csv"))
        .arg("--output")
        .arg(&out_path)
        .output()
        .unwrap();
    ok(&out);
    let store = fx_data::FeatureStore::open(&out_path).unwrap();
    assert_eq!(store.rows(), 300);

    let bad: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("features_bad.json")).unwrap()).unwrap();
    for case in bad["cases"].as_array().unwrap() {
        let file = case["file"].as_str().unwrap();
        let target = dir.path().join(format!("{file}.safetensors"));
        let out = fx_train()
            .args(["features", "--input"])
            .arg(fixtures().join(file))
            .arg("--output")
            .arg(&target)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{file} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        let expected = format!("{file}:{}: {}", case["line"], case["rule"].as_str().unwrap());
        assert!(err.contains(&expected), "{file}: expected {expected:?} in {err:?}");
        assert!(!target.exists(), "{file}: a partial output was left behind");
    }
    // Nothing but the one good output: no temporary files left over.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn features_missing_input_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let out = fx_train()
        .args(["features", "--input", "/nonexistent/bars.csv", "--output"])
        .arg(dir.path().join("x.safetensors"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/bars.csv"), "{err}");
}

// ---------------------------------------------------------------- training runs

/// A run small enough for a test: 4 accounts, 16-step episodes, a 32-wide network.
fn tiny_config(dir: &Path, model: &str, steps: u64, extra: &str) -> PathBuf {
    let path = dir.join(format!("tiny-{model}.toml"));
    let text = format!(
        r#"model = "{model}"
steps = {steps}
checkpoint_every = 10
log_every = 5
device = "cpu"
[synthetic]
bars = 500
[env]
num_envs = 4
episode_len = 16
[dqn]
batch_size = 32
replay_capacity = 2000
learning_starts = 64
[dqn.net]
state_dim = 56
hidden = 32
n_actions = 3
[ppo]
num_steps = 8
epochs = 2
minibatch_size = 16
[ppo.net]
state_dim = 56
hidden = 32
n_actions = 3
{extra}
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn train(config: &Path, out: &Path, extra: &[&str]) -> Output {
    fx_train().arg("train").arg("--config").arg(config).arg("--out").arg(out).args(extra).output().unwrap()
}

/// `fx-train train --resume --quiet --out RUN`: a resumed run takes its saved config.toml.
fn resume(out: &Path) -> Output {
    fx_train().args(["train", "--resume", "--quiet", "--out"]).arg(out).output().unwrap()
}

fn err_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected failure, got success: {}", String::from_utf8_lossy(&out.stdout));
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(err.lines().count(), 1, "expected a one-line error, got {err:?}");
    err
}

/// Every tensor of a safetensors file, as raw bytes by name.
fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, v.data().to_vec())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn checkpoint(run: &Path, step: u64) -> PathBuf {
    run.join(format!("checkpoint-{step:010}.safetensors"))
}

/// `fx-train train --config CFG --out RUN --quiet` in the background (stderr piped for the
/// caller to read), returned once checkpoint `step` exists (or after 120 s).
fn spawn_until_checkpoint(cfg: &Path, run: &Path, step: u64) -> std::process::Child {
    let child = fx_train()
        .arg("train")
        .arg("--config")
        .arg(cfg)
        .arg("--out")
        .arg(run)
        .arg("--quiet")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !checkpoint(run, step).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child
}

#[test]
fn train_writes_a_complete_run_folder_and_eval_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["dqn", "ppo"] {
        let run = dir.path().join(model);
        let out = train(&tiny_config(dir.path(), model, 40, ""), &run, &["--quiet"]);
        let text = ok(&out);
        assert!(text.contains("backtest of") && text.contains("buy & hold"), "{text}");
        for f in ["config.toml", "metrics.jsonl", "report.json", "equity.png", "training.png"] {
            assert!(run.join(f).exists(), "{model}: {f} missing");
        }
        assert!(checkpoint(&run, 40).exists());
        // config.toml holds the resolved config, every default written out.
        let cfg = std::fs::read_to_string(run.join("config.toml")).unwrap();
        assert!(cfg.contains("episode_len = 16") && cfg.contains("keep_checkpoints"), "{cfg}");
        let first: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().lines().next().unwrap())
                .unwrap();
        for k in ["env_steps", "updates", "skipped_steps", "train_samples_per_s", "elapsed_s"] {
            assert!(first.get(k).is_some(), "{model}: metrics line lacks {k}: {first}");
        }
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
        for k in [
            "total_return",
            "annualised_return",
            "sharpe",
            "sortino",
            "max_drawdown",
            "hit_rate",
            "turnover",
            "cost_paid",
        ] {
            assert!(report["agent"]["stats"][k].is_number(), "{model}: report lacks {k}");
        }
        let profile = &report["profile"];
        assert!(profile["update"].as_f64().unwrap() > 0.0);
        for k in ["update_forward", "update_backward", "update_device_wait", "update_optimizer", "env_collect"] {
            assert!(profile[k].as_f64().is_some_and(|v| v >= 0.0), "{model}: profile lacks {k}");
        }
        assert!(
            profile["update_forward"].as_f64().unwrap() > 0.0 && profile["update_backward"].as_f64().unwrap() > 0.0
        );
        let out = fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap();
        assert!(ok(&out).contains("backtest of"));
        assert!(run.join("eval.json").exists());
    }
}

#[test]
fn killed_and_resumed_run_ends_with_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 400;
    let cfg = tiny_config(dir.path(), "dqn", steps, "");
    let straight = dir.path().join("straight");
    ok(&train(&cfg, &straight, &["--quiet"]));

    let killed = dir.path().join("killed");
    // Wait for a few checkpoints, then SIGKILL (no chance to clean up).
    let mut child = spawn_until_checkpoint(&cfg, &killed, 30);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!checkpoint(&killed, steps).exists(), "the run finished before it was killed; make it longer");
    // The killed process held the folder's lock; the OS released it with the process.
    assert!(killed.join("run.lock").exists());
    // Resuming a killed run continues from its last checkpoint to the end.
    ok(&resume(&killed));
    let (a, b) = (tensors(&checkpoint(&straight, steps)), tensors(&checkpoint(&killed, steps)));
    assert_eq!(a.len(), b.len());
    for ((na, da), (nb, db)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(da == db, "{na} differs between the uninterrupted and the resumed run");
    }
}

#[test]
fn ctrl_c_checkpoints_exits_130_and_resume_finishes_identically() {
    interrupt_checkpoints_and_resume_finishes_identically("-INT");
}

/// SIGTERM and SIGHUP (schedulers, closed terminals) are handled like Ctrl-C.
#[test]
fn sigterm_and_sighup_checkpoint_like_ctrl_c() {
    interrupt_checkpoints_and_resume_finishes_identically("-TERM");
    interrupt_checkpoints_and_resume_finishes_identically("-HUP");
}

fn interrupt_checkpoints_and_resume_finishes_identically(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let steps = 400;
    let cfg = tiny_config(dir.path(), "dqn", steps, "");
    let straight = dir.path().join("straight");
    ok(&train(&cfg, &straight, &["--quiet"]));

    let run = dir.path().join("interrupted");
    let child = spawn_until_checkpoint(&cfg, &run, 20);
    let status = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted at step") && err.contains("--resume"), "{err}");
    assert!(!checkpoint(&run, steps).exists(), "the run finished before the interrupt; make it longer");
    // The checkpoint written on Ctrl-C is the latest; resuming without flags keeps the
    // saved length (400 steps, not the default) and ends where the straight run ended.
    let out = fx_train().args(["train", "--resume", "--quiet", "--out"]).arg(&run).output().unwrap();
    ok(&out);
    assert_eq!(tensors(&checkpoint(&straight, steps)), tensors(&checkpoint(&run, steps)));
}

#[test]
fn environment_overrides_reach_the_run_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 6, "");
    let run = dir.path().join("env");
    let out = fx_train()
        .arg("train")
        .arg("--config")
        .arg(&cfg)
        .arg("--out")
        .arg(&run)
        .args(["--quiet", "--precision", "f32"])
        .env("FX_BATCH_SIZE", "48")
        .env("FX_PRECISION", "bf16")
        .output()
        .unwrap();
    ok(&out);
    let saved = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(saved.contains("batch_size = 48"), "FX_BATCH_SIZE did not reach the run:\n{saved}");
    assert!(saved.contains("precision = \"f32\""), "the --precision flag must win over FX_PRECISION:\n{saved}");
}

/// The batch a run uses and where it came from: printed, in config.toml as a number, and in
/// the first metrics line. On the CPU `auto` keeps the config's (model key) value.
#[test]
fn the_batch_and_its_source_are_printed_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let first_metrics = |run: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        serde_json::from_str(text.lines().next().unwrap()).unwrap()
    };
    // The tiny config sets dqn.batch_size itself: that wins over auto.
    let cfg = tiny_config(dir.path(), "dqn", 10, "");
    let run = dir.path().join("key");
    let stdout = ok(&train(&cfg, &run, &["--quiet"]));
    assert!(stdout.contains("batch 32 (dqn.batch_size, source config (model key)"), "{stdout}");
    let m = first_metrics(&run);
    assert_eq!((m["batch_size"].as_u64(), m["batch_source"].as_str()), (Some(32), Some("config (model key)")));
    assert!(std::fs::read_to_string(run.join("config.toml")).unwrap().contains("batch = 32"));
    // `--batch-size auto` asks for the budget; on the CPU that is the config's value.
    let run = dir.path().join("auto");
    let stdout = ok(&train(&cfg, &run, &["--quiet", "--batch-size", "auto"]));
    assert!(stdout.contains("batch 32 (dqn.batch_size, source cpu default"), "{stdout}");
    // A flag, and FX_BATCH_SIZE.
    let run = dir.path().join("flag");
    let stdout = ok(&train(&cfg, &run, &["--quiet", "--batch-size", "24"]));
    assert!(stdout.contains("batch 24 (dqn.batch_size, source flag)"), "{stdout}");
    assert_eq!(first_metrics(&run)["batch_size"].as_u64(), Some(24));
    // Resuming with the same value is accepted, another is refused naming both.
    ok(&train(&cfg, &run, &["--quiet", "--resume", "--batch-size", "24", "--steps", "15"]));
    let e = err_line(&train(&cfg, &run, &["--resume", "--batch-size", "40"]));
    assert!(e.contains("--batch-size 40 differs from the saved run's 24"), "{e}");
    let run = dir.path().join("env");
    let out = fx_train()
        .args(["train", "--quiet", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&run)
        .env("FX_BATCH_SIZE", "20")
        .output()
        .unwrap();
    assert!(ok(&out).contains("batch 20 (dqn.batch_size, source FX_BATCH_SIZE)"));
    // A file that sets `batch = N` and no model key resumes with that file.
    let text = std::fs::read_to_string(&cfg).unwrap().replace("batch_size = 32\n", "");
    let batch_cfg = dir.path().join("batch-key.toml");
    std::fs::write(&batch_cfg, format!("batch = 24\n{text}")).unwrap();
    let run = dir.path().join("batch-key");
    assert!(ok(&train(&batch_cfg, &run, &["--quiet"])).contains("batch 24 (dqn.batch_size, source config)"));
    ok(&train(&batch_cfg, &run, &["--quiet", "--resume", "--steps", "15"]));
    // (clap's own usage error for a bad flag value.)
    let out = train(&cfg, &dir.path().join("bad"), &["--batch-size", "0"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("batch must be \"auto\" or a positive integer"), "{e}");
}

#[test]
fn train_on_real_bars_from_csv() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 12, "");
    let out =
        train(&cfg, &dir.path().join("aapl"), &["--quiet", "--data", "../../../shared/data/aapl_daily_2000_2013.csv"]);
    let text = ok(&out);
    assert!(text.contains("aapl_daily_2000_2013.csv"), "{text}");
    // Daily equity bars: about 252 bars a year.
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("aapl/report.json")).unwrap()).unwrap();
    let ppy = report["periods_per_year"].as_f64().unwrap();
    assert!((240.0..265.0).contains(&ppy), "{ppy}");
}

#[test]
fn bad_runs_are_one_line_errors_and_overwrite_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 10, "");
    let run = dir.path().join("run");
    ok(&train(&cfg, &run, &["--quiet"]));
    let before = std::fs::read(run.join("report.json")).unwrap();

    // A second run into the same folder.
    assert!(err_line(&train(&cfg, &run, &["--quiet"])).contains("--resume"));
    // A bad config file: unknown key, named with its path.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "stepz = 3\n").unwrap();
    let e = err_line(&train(&bad, &dir.path().join("x"), &[]));
    assert!(e.contains("bad.toml") && e.contains("stepz"), "{e}");
    // A missing data file.
    let e = err_line(&train(&cfg, &dir.path().join("y"), &["--data", "/nope/bars.csv"]));
    assert!(e.contains("/nope/bars.csv"), "{e}");
    // A feature file of the wrong width.
    let narrow = dir.path().join("narrow.safetensors");
    write_narrow_feature_file(&narrow);
    let e = err_line(&train(&cfg, &dir.path().join("z"), &["--data", narrow.to_str().unwrap()]));
    assert!(e.contains("narrow.safetensors"), "{e}");
    // --resume with a flag that would change the saved run is refused, naming both values.
    let e = err_line(&train(&cfg, &run, &["--resume", "--seed", "3"]));
    assert!(e.contains("--seed 3 differs from the saved run's 7"), "{e}");
    // An explicit GPU request that cannot be met is an error, not a silent CPU run.
    if !cfg!(feature = "cuda") {
        let e = err_line(&train(&cfg, &dir.path().join("gpu"), &["--device", "cuda"]));
        assert!(e.contains("cuda") && e.contains("not available"), "{e}");
    }
    // A checkpoint of another model: resume the DQN run as PPO.
    let ppo_cfg = tiny_config(dir.path(), "ppo", 10, "");
    std::fs::copy(&cfg, dir.path().join("keep.toml")).unwrap();
    std::fs::write(run.join("config.toml"), std::fs::read(&ppo_cfg).unwrap()).unwrap();
    let e = err_line(&resume(&run));
    assert!(e.contains("dqn") && e.contains("ppo") && e.contains("checkpoint"), "{e}");
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("dqn") && e.contains("ppo"), "{e}");
    assert_eq!(std::fs::read(run.join("report.json")).unwrap(), before, "report.json was overwritten");
    // Eval of a folder that is no run.
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(dir.path()).output().unwrap());
    assert!(e.contains("not a run folder"), "{e}");
}

/// A feature file whose `market` has 50 columns instead of 51 (otherwise valid).
fn write_narrow_feature_file(path: &Path) {
    let rows = 300usize;
    let market: Vec<f32> = (0..rows * 50).map(|i| (i % 17) as f32 * 0.1).collect();
    let known = vec![0.5f32; rows * 4];
    let logret = vec![0.0f32; rows];
    let close: Vec<f64> = (0..rows).map(|i| 100.0 + i as f64).collect();
    let ts: Vec<i64> = (0..rows as i64).map(|i| 1_700_000_000 + 3600 * i).collect();
    let bytes = |v: &[u8]| v.to_vec();
    let m = bytes(bytemuck_cast(&market));
    let k = bytes(bytemuck_cast(&known));
    let l = bytes(bytemuck_cast(&logret));
    let c: Vec<u8> = close.iter().flat_map(|x| x.to_le_bytes()).collect();
    let t: Vec<u8> = ts.iter().flat_map(|x| x.to_le_bytes()).collect();
    use safetensors::tensor::{Dtype, TensorView};
    let views = vec![
        ("market", TensorView::new(Dtype::F32, vec![rows, 50], &m).unwrap()),
        ("known", TensorView::new(Dtype::F32, vec![rows, 4], &k).unwrap()),
        ("logret_next", TensorView::new(Dtype::F32, vec![rows], &l).unwrap()),
        ("close", TensorView::new(Dtype::F64, vec![rows], &c).unwrap()),
        ("timestamp", TensorView::new(Dtype::I64, vec![rows], &t).unwrap()),
    ];
    let names: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
    let meta = std::collections::HashMap::from([
        ("schema".to_string(), "fx-features/1".to_string()),
        ("feature_names".to_string(), serde_json::to_string(&names).unwrap()),
        ("source".to_string(), "narrow".to_string()),
        ("rows".to_string(), rows.to_string()),
    ]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

fn bytemuck_cast(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

// ---------------------------------------------------------------- sequence models

/// A TFT / MAMBA-2 run small enough for a test: 500 synthetic bars, width 8, 3 epochs.
fn tiny_seq_config(dir: &Path, model: &str) -> PathBuf {
    let path = dir.join(format!("tiny-{model}.toml"));
    let text = format!(
        r#"model = "{model}"
device = "cpu"
mamba2_seq_len = 16
[synthetic]
bars = 500
[env]
episode_len = 16
[tft]
d = 8
n_head = 2
L_enc = 8
H = 2
dropout = 0.0
[mamba2]
d_model = 8
n_layer = 1
d_state = 4
headdim = 4
chunk_size = 4
[seq]
epochs = 3
batch_size = 32
lr = 0.005
patience = 5
"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn json_file(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn seq_models_write_a_complete_run_folder_and_eval_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["tft", "mamba2"] {
        let run = dir.path().join(model);
        let text = ok(&train(&tiny_seq_config(dir.path(), model), &run, &["--quiet"]));
        assert!(text.contains(&format!("forecasts of {model}")) && text.contains("directional accuracy"), "{text}");
        for f in ["config.toml", "metrics.jsonl", "report.json", "training.png", "forecast.png"] {
            assert!(run.join(f).exists(), "{model}: {f} missing");
        }
        assert!(checkpoint(&run, 3).exists(), "{model}: no checkpoint after epoch 3");
        let cfg = std::fs::read_to_string(run.join("config.toml")).unwrap();
        assert!(cfg.contains("[seq]") && cfg.contains("L_enc = 8") && cfg.contains("mamba2_seq_len"), "{cfg}");
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{model}: one metrics line per epoch");
        for k in ["epoch", "train_loss", "val_loss", "lr", "train_samples_per_s", "elapsed_s"] {
            assert!(lines[0].get(k).is_some(), "{model}: metrics line lacks {k}: {}", lines[0]);
        }
        assert_eq!(lines[2]["epoch"], 3);
        let rep = json_file(&run.join("report.json"));
        assert_eq!(rep["model"], model);
        for k in ["mse_model", "mse_zero", "mse_last"] {
            assert!(rep["point"][k].is_number(), "{model}: report lacks point.{k}");
        }
        for k in ["directional_accuracy", "rank_correlation"] {
            assert!(rep["forecast"][k].is_number(), "{model}: report lacks forecast.{k}");
        }
        if model == "tft" {
            assert_eq!(rep["forecast"]["pinball"].as_array().unwrap().len(), 3);
            assert!(rep["forecast"]["interval_coverage"].is_number());
        }
        assert!(rep["profile"]["train"].as_f64().unwrap() > 0.0);
        // The share of the epochs spent building batches: per epoch and over the run.
        let stall = rep["profile"]["data_stall_fraction"].as_f64().unwrap();
        assert!(stall > 0.0 && stall < 1.0, "{model}: data_stall_fraction {stall}");
        assert!(text.contains("data stall: "), "{text}");
        for l in &lines {
            let f = l["data_stall_fraction"].as_f64().unwrap();
            assert!(f > 0.0 && f < 1.0, "{model}: {l}");
        }
        assert_eq!(lines[0]["batch_source"], "config (model key)", "the tiny config sets seq.batch_size");
        assert!(lines[1].get("batch_size").is_none(), "only the first line names the batch");
        let out = fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap();
        assert!(ok(&out).contains(&format!("forecasts of {model}")));
        // eval scores the same (best) weights the run's report did.
        let ev = json_file(&run.join("eval.json"));
        assert_eq!(ev["point"], rep["point"], "{model}");
    }
}

#[test]
fn seq_run_resumed_from_an_epoch_checkpoint_ends_with_identical_weights() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["tft", "mamba2"] {
        let cfg = tiny_seq_config(dir.path(), model);
        let straight = dir.path().join(format!("{model}-straight"));
        ok(&train(&cfg, &straight, &["--quiet"]));
        // The state a run killed during epoch 2 leaves: checkpoints up to epoch 1 and
        // metrics lines up to epoch 2 at most.
        let killed = dir.path().join(format!("{model}-killed"));
        ok(&train(&cfg, &killed, &["--quiet"]));
        for step in [2, 3] {
            std::fs::remove_file(checkpoint(&killed, step)).unwrap();
            std::fs::remove_file(killed.join(format!("checkpoint-{step:010}.json"))).unwrap();
        }
        std::fs::remove_file(killed.join("report.json")).unwrap();
        let text = ok(&resume(&killed));
        assert!(text.contains("forecasts of"), "{text}");
        let (a, b) = (tensors(&checkpoint(&straight, 3)), tensors(&checkpoint(&killed, 3)));
        assert_eq!(a.len(), b.len());
        for ((na, da), (nb, db)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(da == db, "{model}: {na} differs between the uninterrupted and the resumed run");
        }
        let epochs: Vec<u64> = std::fs::read_to_string(killed.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["epoch"].as_u64().unwrap())
            .collect();
        assert_eq!(epochs, vec![1, 2, 3], "{model}");
        assert_eq!(json_file(&killed.join("report.json"))["point"], json_file(&straight.join("report.json"))["point"]);
    }
}

#[test]
fn seq_checkpoint_of_another_model_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let tft_cfg = tiny_seq_config(dir.path(), "tft");
    let mamba_cfg = tiny_seq_config(dir.path(), "mamba2");
    let run = dir.path().join("tft");
    ok(&train(&tft_cfg, &run, &["--quiet"]));
    let before = std::fs::read(run.join("report.json")).unwrap();
    // The run's config now names another sequence model.
    std::fs::write(run.join("config.toml"), std::fs::read(&mamba_cfg).unwrap()).unwrap();
    let e = err_line(&resume(&run));
    assert!(e.contains("tft") && e.contains("mamba2") && e.contains("checkpoint"), "{e}");
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("tft") && e.contains("mamba2"), "{e}");
    // ... or an RL agent.
    let dqn_cfg = tiny_config(dir.path(), "dqn", 10, "");
    std::fs::write(run.join("config.toml"), std::fs::read(&dqn_cfg).unwrap()).unwrap();
    let e = err_line(&resume(&run));
    assert!(e.contains("tft") && e.contains("dqn") && e.contains("checkpoint"), "{e}");
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("tft") && e.contains("dqn"), "{e}");
    assert_eq!(std::fs::read(run.join("report.json")).unwrap(), before, "report.json was overwritten");
    // A DQN run whose config now names a TFT.
    let rl = dir.path().join("dqn");
    ok(&train(&dqn_cfg, &rl, &["--quiet"]));
    std::fs::write(rl.join("config.toml"), std::fs::read(&tft_cfg).unwrap()).unwrap();
    let e = err_line(&resume(&rl));
    assert!(e.contains("dqn") && e.contains("tft") && e.contains("checkpoint"), "{e}");
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(&rl).output().unwrap());
    assert!(e.contains("dqn") && e.contains("tft"), "{e}");
}

#[test]
fn a_second_process_on_a_run_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 400;
    let cfg = tiny_config(dir.path(), "dqn", steps, "");
    let straight = dir.path().join("straight");
    ok(&train(&cfg, &straight, &["--quiet"]));

    let run = dir.path().join("busy");
    let child = spawn_until_checkpoint(&cfg, &run, 10);
    // Both a resume and a new run on the busy folder are refused at once.
    let err = err_line(&resume(&run));
    assert!(err.contains(&run.display().to_string()) && err.contains(&format!("process {}", child.id())), "{err}");
    let err = err_line(&train(&cfg, &run, &["--quiet"]));
    assert!(err.contains("already holds a run") || err.contains("in use"), "{err}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the first run failed: {}", String::from_utf8_lossy(&out.stderr));
    // The first run was not disturbed: same final weights and metrics as a straight run.
    assert_eq!(tensors(&checkpoint(&straight, steps)), tensors(&checkpoint(&run, steps)));
    let lines = |p: &Path| std::fs::read_to_string(p.join("metrics.jsonl")).unwrap().lines().count();
    assert_eq!(lines(&straight), lines(&run));
}

#[test]
fn configs_that_cannot_work_are_refused_and_leave_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &str, &str); 5] = [
        (
            "dqn",
            "batch_size = 32",
            "batch_size = 1000000000000",
            "dqn.batch_size 1000000000000 exceeds dqn.replay_capacity",
        ),
        (
            "dqn",
            "learning_starts = 64",
            "learning_starts = 5000",
            "dqn: learning_starts (5000) exceeds replay_capacity (2000)",
        ),
        (
            "dqn",
            "replay_capacity = 2000",
            "replay_capacity = 1000000000000",
            "dqn.replay_capacity 1000000000000 (460 bytes a transition) needs",
        ),
        ("ppo", "minibatch_size = 16", "minibatch_size = 100", "ppo.minibatch_size 100 exceeds"),
        ("dqn", "episode_len = 16", "episode_len = 5000", "an episode of 5000 steps needs at least 5001"),
    ];
    for (k, (model, from, to, want)) in cases.into_iter().enumerate() {
        let cfg = tiny_config(dir.path(), model, 20, "");
        let text = std::fs::read_to_string(&cfg).unwrap();
        assert!(text.contains(from), "{from}");
        let cfg_k = dir.path().join(format!("bad-{k}.toml"));
        std::fs::write(&cfg_k, text.replacen(from, to, 1)).unwrap();
        let out_dir = dir.path().join(format!("bad-run-{k}"));
        let err = err_line(&train(&cfg_k, &out_dir, &["--quiet"]));
        assert!(err.contains(want), "case {k}: {err}");
        assert!(!out_dir.exists(), "case {k}: the refused run left {} behind", out_dir.display());
    }
    // A sequence model's batch larger than its training windows (and small enough for the
    // memory check: a batch of 100,000 windows of this TFT would need ~40 GiB).
    let cfg = tiny_seq_config(dir.path(), "tft");
    let text = std::fs::read_to_string(&cfg).unwrap().replacen("batch_size = 32", "batch_size = 2000", 1);
    std::fs::write(&cfg, text).unwrap();
    let out_dir = dir.path().join("bad-seq-run");
    let err = err_line(&train(&cfg, &out_dir, &["--quiet"]));
    assert!(err.contains("seq.batch_size 2000 exceeds the") && err.contains("training windows"), "{err}");
    assert!(!out_dir.exists(), "the refused run left {} behind", out_dir.display());
}

#[test]
fn damaged_checkpoints_are_skipped_with_a_warning_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 40, "");
    let run = dir.path().join("run");
    ok(&train(&cfg, &run, &["--quiet"]));
    let other = dir.path().join("ppo");
    ok(&train(&tiny_config(dir.path(), "ppo", 20, ""), &other, &["--quiet"]));
    let (state, sidecar) = (checkpoint(&run, 40), run.join(format!("checkpoint-{:010}.json", 40)));
    let (good_state, good_sidecar) = (std::fs::read(&state).unwrap(), std::fs::read(&sidecar).unwrap());
    let mut flipped = good_state.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x40;
    let foreign = std::fs::read_dir(&other)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name().unwrap().to_string_lossy().starts_with("checkpoint-")
                && p.extension().is_some_and(|e| e == "json")
        })
        .map(|p| std::fs::read(p).unwrap())
        .expect("the PPO run wrote a checkpoint");
    type Damage<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let bad_norm = {
        let mut v: serde_json::Value = serde_json::from_slice(&good_sidecar).unwrap();
        v["norm_std"][0] = serde_json::json!(-1.0);
        serde_json::to_vec(&v).unwrap()
    };
    let damages: [Damage<'_>; 5] = [
        ("a normaliser with a negative scale", Box::new(|| std::fs::write(&sidecar, &bad_norm).unwrap())),
        ("truncated", Box::new(|| std::fs::write(&state, &good_state[..good_state.len() / 3]).unwrap())),
        ("one flipped byte", Box::new(|| std::fs::write(&state, &flipped).unwrap())),
        ("missing sidecar", Box::new(|| std::fs::remove_file(&sidecar).unwrap())),
        ("another run's sidecar", Box::new(|| std::fs::write(&sidecar, &foreign).unwrap())),
    ];
    for (what, damage) in &damages {
        damage();
        let out = fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{what}: eval failed: {err}");
        let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("warning: skipping checkpoint 40")).collect();
        assert_eq!(warnings.len(), 1, "{what}: {err}");
        if what.starts_with("a normaliser") {
            assert!(warnings[0].contains("checkpoint-0000000040.json: its normaliser"), "{err}");
        }
        assert!(state.exists() || sidecar.exists(), "{what}: the damaged checkpoint was deleted");
        std::fs::write(&state, &good_state).unwrap();
        std::fs::write(&sidecar, &good_sidecar).unwrap();
    }
    // A resume skips the damaged newest checkpoint too, and finishes from the one before;
    // the damaged files are set aside in damaged/, not overwritten when the run passes
    // step 40 again.
    std::fs::write(&state, &good_state[..100]).unwrap();
    let out = fx_train().args(["train", "--resume", "--steps", "50", "--quiet", "--out"]).arg(&run).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: skipping checkpoint 40"));
    assert!(checkpoint(&run, 50).exists());
    let aside = run.join("damaged").join("checkpoint-0000000040.safetensors");
    assert_eq!(std::fs::read(&aside).unwrap(), &good_state[..100], "the damaged state file was not kept");
    assert!(run.join("damaged").join("checkpoint-0000000040.json").exists());
}

/// A run folder whose every checkpoint is damaged is not trained again from step 0: the
/// resume (and eval) fail in one line naming them, and every file stays; `--restart` then
/// starts it over explicitly, keeping the damaged files.
#[test]
fn a_resume_with_every_checkpoint_damaged_fails_and_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 30, "");
    let run = dir.path().join("run");
    ok(&train(&cfg, &run, &["--quiet"]));
    let states: Vec<PathBuf> = [10, 20, 30].iter().map(|&s| checkpoint(&run, s)).filter(|p| p.exists()).collect();
    assert!(!states.is_empty());
    for p in &states {
        std::fs::write(p, b"damaged").unwrap();
    }
    let before: Vec<_> = std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().file_name()).collect();
    let e = err_line(
        &fx_train().args(["train", "--resume", "--quiet", "--steps", "60", "--out"]).arg(&run).output().unwrap(),
    );
    assert!(e.contains("checkpoint(s) in") && e.contains("verifies") && e.contains("nothing was changed"), "{e}");
    assert!(e.contains("add --restart to --resume"), "{e}");
    assert!(e.contains("steps 10, 20, 30") || states.len() < 3, "{e}");
    let e = err_line(&fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("verifies") && !e.contains("--restart"), "eval has no --restart: {e}");
    // Nothing pruned, moved or overwritten, and no training happened.
    for p in &states {
        assert_eq!(std::fs::read(p).unwrap(), b"damaged", "{}", p.display());
    }
    assert!(!checkpoint(&run, 60).exists(), "the run trained anyway");
    let mut after: Vec<_> = std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().file_name()).collect();
    let mut before = before;
    before.sort();
    after.sort();
    assert_eq!(before, after);
    // Starting over is explicit: --restart (only with --resume) trains from step 0 under
    // the saved config, the damaged files kept in damaged/.
    let e = err_line(&fx_train().args(["train", "--restart", "--quiet", "--out"]).arg(&run).output().unwrap());
    assert!(e.contains("--resume"), "{e}");
    let out = fx_train().args(["train", "--resume", "--restart", "--quiet", "--out"]).arg(&run).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("--restart starts the run over from step 0") && err.contains("damaged"), "{err}");
    assert!(checkpoint(&run, 30).exists(), "the restarted run did not train to its end");
    for p in &states {
        let kept = run.join("damaged").join(p.file_name().unwrap());
        assert_eq!(std::fs::read(&kept).unwrap(), b"damaged", "{}", kept.display());
    }
    // The first run's report went aside with its checkpoints; the one here is the new run's.
    assert!(run.join("damaged").join("report.json").exists());
    assert!(run.join("report.json").exists(), "the restarted run wrote no report");
}

#[test]
fn flags_as_users_type_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 20, "");
    let run = dir.path().join("run");
    ok(&train(&cfg, &run, &["--quiet", "--model", "dqn", "--seed", "7"]));
    // The original command with --resume appended (same values) continues the run.
    ok(&train(&cfg, &run, &["--quiet", "--model", "dqn", "--seed", "7", "--resume", "--steps", "30"]));
    assert!(checkpoint(&run, 30).exists());
    // A different value is refused, naming both.
    let e = err_line(&train(&cfg, &run, &["--resume", "--model", "ppo"]));
    assert!(e.contains("--model ppo differs from the saved run's dqn"), "{e}");
    let other = tiny_config(dir.path(), "ppo", 20, "");
    let e = err_line(&train(&other, &run, &["--resume"]));
    assert!(e.contains("differs from the saved run's config.toml"), "{e}");
    // Flags of the other kind of model are refused with a hint, never ignored.
    let e = err_line(&train(&cfg, &dir.path().join("a"), &["--epochs", "3"]));
    assert!(e.contains("--epochs is for tft/mamba2") && e.contains("--steps"), "{e}");
    assert!(!dir.path().join("a").exists());
    let e = err_line(
        &fx_train()
            .args(["train", "--model", "tft", "--steps", "3", "--out"])
            .arg(dir.path().join("b"))
            .output()
            .unwrap(),
    );
    assert!(e.contains("--steps counts environment steps") && e.contains("--epochs"), "{e}");
}

#[test]
fn thread_count_follows_the_cpu_affinity_mask() {
    // One CPU allowed: every model's runs use one thread (and so does FX_THREADS unset).
    let out = Command::new("taskset")
        .args(["-c", "0"])
        .arg(env!("CARGO_BIN_EXE_fx-train"))
        .args(["hw", "--json", "--device", "cpu"])
        .env_remove("FX_THREADS")
        .output()
        .expect("taskset (util-linux) runs");
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    let t = &v["cpu_threads"];
    assert_eq!(
        (t["usable_cpus"].as_u64(), t["sequence_models"]["value"].as_u64(), t["rl_agents"]["value"].as_u64()),
        (Some(1), Some(1), Some(1)),
        "{t}"
    );
    // FX_THREADS overrides, with its source named.
    let out = fx_train().args(["hw", "--json", "--device", "cpu"]).env("FX_THREADS", "3").output().unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(v["cpu_threads"]["sequence_models"]["value"].as_u64(), Some(3));
    let e = err_line(&fx_train().args(["hw", "--device", "cpu"]).env("FX_THREADS", "zero").output().unwrap());
    assert!(e.contains("FX_THREADS") && e.contains("zero"), "{e}");
}

#[test]
fn a_failed_checkpoint_write_stops_the_run_and_keeps_the_earlier_ones() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 400, "");
    let run = dir.path().join("run");
    // The checkpoints grow with the replay buffer; a file-size limit of 160 KiB lets the
    // early ones through and stops a later one.
    let cmd = format!(
        "ulimit -f 160; exec {} train --config {} --out {} --quiet",
        env!("CARGO_BIN_EXE_fx-train"),
        cfg.display(),
        run.display()
    );
    let out = Command::new("bash").args(["-c", &cmd]).output().unwrap();
    let err = err_line(&out);
    assert!(err.contains("checkpoint-") && err.contains(&run.display().to_string()), "{err}");
    assert!(!checkpoint(&run, 400).exists(), "the limit did not stop the run; lower it");
    assert!(checkpoint(&run, 10).exists() || checkpoint(&run, 20).exists() || checkpoint(&run, 30).exists());
    // No temporary file is left, and the newest earlier checkpoint still loads.
    let tmp: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "{:?}", tmp.iter().map(|e| e.file_name()).collect::<Vec<_>>());
    let out = fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap();
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------- sweeps

/// `fx-train sweep` on the CPU: 3 trials as one population, their rows and leaderboard, the
/// best trained again as an ordinary run that ends with exactly its trial's weights (a member
/// is its solo run), one market for every trial, and a second call that trains nothing again.
#[test]
fn sweep_ranks_trials_and_reruns_the_best() {
    sweep_of("dqn", "dqn.optimizer.lr", "online.", 10, 40);
}

/// The same for PPO: the trials train as one PPO population (whole iterations), and the best
/// trial's run folder ends with its trial's weights exactly.
#[test]
fn ppo_sweep_ranks_trials_and_reruns_the_best() {
    sweep_of("ppo", "ppo.loss.ent_coef", "model.", 12, 64);
}

/// A 3-trial sweep file of `model` (the tiny run config of `steps` under `[run]`) over `key`
/// and the seed, its `best` trials run again.
fn sweep_file(dir: &Path, model: &str, key: &str, steps: u64, best: usize) -> PathBuf {
    let run = std::fs::read_to_string(tiny_config(dir, model, steps, "")).unwrap();
    // The run config under [run]: every table header gains the prefix.
    let run: String = run
        .lines()
        .map(|l| match l.strip_prefix('[') {
            Some(rest) => format!("[run.{rest}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let sweep = dir.join("sweep.toml");
    std::fs::write(
        &sweep,
        format!(
            "trials = 3\nseed = 5\nsampler = \"random\"\nbest = {best}\n[space]\n\"{key}\" = {{ log_uniform = [1e-3, 1e-2] }}\nseed = {{ int = [0, 99] }}\n[run]\n{run}"
        ),
    )
    .unwrap();
    sweep
}

/// A sweep stopped by SIGTERM inside its wave (a scheduler's preemption) exits 130 with the
/// wave checkpointed, and the same command goes on from that env step to the uninterrupted
/// sweep's rows.
#[test]
fn a_sweep_stopped_by_sigterm_inside_its_wave_resumes_to_the_same_rows() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let sweep = sweep_file(dir.path(), "dqn", "dqn.optimizer.lr", 3000, 0);
    let cmd = |out: &Path| {
        let mut c = fx_train();
        c.arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(out);
        c
    };
    let straight = dir.path().join("straight");
    ok(&cmd(&straight).output().unwrap());
    let want = std::fs::read_to_string(straight.join("trials.jsonl")).unwrap();

    let stopped = dir.path().join("stopped");
    let mut child = cmd(&stopped).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    // Past learning_starts (64), so the checkpoint holds trained members and full replays.
    let seen = lines.by_ref().map_while(|l| l.ok()).find(|l| l.contains("env step 100/3000"));
    assert!(seen.is_some(), "the sweep never logged env step 100");
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    assert_eq!(child.wait().unwrap().code(), Some(130), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("checkpointed at env step")), "{rest:?}");
    assert!(stopped.join("waves/wave-0.safetensors").exists());
    assert!(!stopped.join("sweep.json").exists(), "the sweep stopped before its end; make it longer");
    let text = ok(&cmd(&stopped).output().unwrap());
    assert!(text.contains("go on from env step"), "{text}");
    assert_eq!(std::fs::read_to_string(stopped.join("trials.jsonl")).unwrap(), want);
    assert!(!stopped.join("waves/wave-0.safetensors").exists(), "a finished wave's checkpoint is removed");
}

/// A 3-trial sweep of `model` over `key` and the seed, its best trial run again.
fn sweep_of(model: &str, key: &str, prefix: &str, n_tensors: usize, steps: u64) {
    let dir = tempfile::tempdir().unwrap();
    let sweep = sweep_file(dir.path(), model, key, steps, 1);
    let out = dir.path().join("sw");
    let text = ok(&fx_train().arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(&out).output().unwrap());
    assert!(text.contains("3 trials tried"), "{text}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("trials.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    let csv = std::fs::read_to_string(out.join("trials.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "{csv}");
    assert!(csv.starts_with(&format!("trial,{key},seed,val_sharpe")), "{csv}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap()).unwrap();
    assert_eq!(doc["trials_tried"], 3);
    let ev = std::fs::read(out.join("tensorboard/trial-2/events.out.tfevents.0.fx-train")).unwrap();
    assert!(ev.windows(10).any(|w| w == b"val/sharpe"), "{} bytes", ev.len());
    assert!(ev.windows(28).any(|w| w == b"_hparams_/session_start_info"), "the trial's HParams session");
    let exp = std::fs::read(out.join("tensorboard/events.out.tfevents.0.fx-train")).unwrap();
    assert!(
        exp.windows(20).any(|w| w == b"_hparams_/experiment") && exp.windows(key.len()).any(|w| w == key.as_bytes())
    );
    let best = doc["best"][0]["trial"].as_u64().unwrap();
    assert!(rows.iter().all(|r| r["val_sharpe"].as_f64().unwrap() <= doc["best"][0]["val_sharpe"].as_f64().unwrap()));
    let run_dir = out.join("best-1");
    assert!(run_dir.join("report.json").exists());
    let cfg = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(cfg.contains("data_seed = 7"), "every trial trains on the base market: {cfg}");
    let ckpt = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max()
        .unwrap();
    let trained: Vec<(String, Vec<u8>)> =
        tensors(&ckpt).into_iter().filter_map(|(n, v)| n.strip_prefix(prefix).map(|n| (n.to_string(), v))).collect();
    let member = tensors(&out.join(format!("weights/trial-{best}.safetensors")));
    assert_eq!(trained.len(), n_tensors);
    assert_eq!(trained, member, "the best run's final weights are its trial's");
    // Done already: nothing is trained again.
    let again = ok(&fx_train().arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(&out).output().unwrap());
    assert!(again.contains("all 3 trials done already"), "{again}");
}

/// Forecaster sweeps: 4 MAMBA-2 trials (one after another, `--epochs 2` over the file's 3)
/// rank by validation loss; each trial's folder reports the validation split only; the best
/// trial, trained again as an ordinary run, scores the test split and ends with its trial's
/// weights exactly (CPU); a sweep killed inside a trial resumes it from its checkpoint to
/// the same rows; `--steps` is refused for a forecaster sweep.
#[test]
fn forecaster_sweeps_rank_by_validation_loss_and_resume_inside_a_trial() {
    let dir = tempfile::tempdir().unwrap();
    let run = std::fs::read_to_string(tiny_seq_config(dir.path(), "mamba2")).unwrap();
    let run: String = run
        .lines()
        .map(|l| match l.strip_prefix('[') {
            Some(rest) => format!("[run.{rest}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let sweep = dir.path().join("sweep.toml");
    let space = "[space]\n\"seq.lr\" = { log_uniform = [1e-3, 2e-2] }\n\"mamba2.d_state\" = { choice = [4, 8] }\n";
    std::fs::write(&sweep, format!("trials = 4\nseed = 3\nsampler = \"sobol\"\nbest = 1\n{space}[run]\n{run}"))
        .unwrap();
    let sweep_cmd = |out: &Path| {
        let mut c = fx_train();
        c.arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(out).args(["--epochs", "2"]);
        c
    };
    let out = dir.path().join("sw");
    let text = ok(&sweep_cmd(&out).output().unwrap());
    assert!(text.contains("4 mamba2 trial(s), one after another") && text.contains("val loss"), "{text}");
    let rows = std::fs::read_to_string(out.join("trials.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = rows.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 4);
    for r in &rows {
        let trial = out.join(format!("trials/trial-{}", r["trial"]));
        let rep = json_file(&trial.join("report.json"));
        assert_eq!(rep["split"], "validation", "a trial never scores the test split");
        assert_eq!(rep["epochs_done"], 2, "--epochs 2");
        assert_eq!(r["val_loss"], rep["best_val_loss"]);
        assert_eq!(r["val_sharpe"], rep["agent"]["stats"]["sharpe"]);
    }
    let doc = json_file(&out.join("sweep.json"));
    assert!(doc["objective"].as_str().unwrap().starts_with("val_loss"), "{doc}");
    for t in 0..4 {
        let ev = std::fs::read(out.join(format!("tensorboard/trial-{t}/events.out.tfevents.0.fx-train"))).unwrap();
        // The version event and 2 epochs x (train/loss, val/loss, lr) + val/sharpe scalars.
        assert!(ev.len() > 7 * 16 && ev.windows(8).any(|w| w == b"val/loss"), "trial {t}: {} bytes", ev.len());
    }
    let losses: Vec<f64> =
        doc["leaderboard"].as_array().unwrap().iter().map(|e| e["val_loss"].as_f64().unwrap()).collect();
    assert!(losses.windows(2).all(|w| w[0] <= w[1]), "lowest validation loss first: {losses:?}");
    let best = doc["best"][0]["trial"].as_u64().unwrap();
    assert_eq!(best, doc["leaderboard"][0]["trial"].as_u64().unwrap());
    let best_run = out.join("best-1");
    assert_eq!(json_file(&best_run.join("report.json"))["split"], "test");
    let weights = |p: &Path| -> Vec<(String, Vec<u8>)> {
        tensors(&checkpoint(p, 2))
            .into_iter()
            .filter(|(n, _)| n.starts_with("best.") || n.starts_with("model."))
            .collect()
    };
    assert_eq!(weights(&best_run), weights(&out.join(format!("trials/trial-{best}"))), "the best run is its trial");

    // Killed inside trial 2 (after its first epoch's checkpoint), then the same command.
    let killed = dir.path().join("killed");
    let mut child = sweep_cmd(&killed).stdout(std::process::Stdio::null()).spawn().unwrap();
    let inside = killed.join("trials/trial-2");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !checkpoint(&inside, 1).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let running = child.try_wait().unwrap().is_none();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(checkpoint(&inside, 1).exists(), "trial 2 never reached its first epoch");
    let mid_trial = running && !inside.join("report.json").exists();
    let text = ok(&sweep_cmd(&killed).output().unwrap());
    assert!(text.contains("trials done already; going on"), "{text}");
    if mid_trial {
        assert!(text.contains("trial 2 as a mamba2 run") && text.contains("(resumed)"), "{text}");
    }
    let strip = |p: &Path| std::fs::read_to_string(p.join("trials.jsonl")).unwrap();
    assert_eq!(strip(&killed), strip(&out), "the resumed sweep's rows are the uninterrupted one's");

    let e = err_line(
        &fx_train()
            .arg("sweep")
            .arg("--config")
            .arg(&sweep)
            .arg("--out")
            .arg(dir.path().join("x"))
            .args(["--steps", "5"])
            .output()
            .unwrap(),
    );
    assert!(e.contains("--steps") && e.contains("--epochs"), "{e}");
    // Another length in the same folder is refused: by the sweep (its sweep.toml), and by a
    // trial's folder when the sweep's record is gone; nothing resumes under it.
    let other = || {
        let mut c = fx_train();
        c.arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(&killed).args(["--epochs", "3"]);
        err_line(&c.output().unwrap())
    };
    let e = other();
    assert!(e.contains("was started with another sweep"), "{e}");
    std::fs::remove_file(killed.join("trials.jsonl")).unwrap();
    std::fs::remove_file(killed.join("sweep.toml")).unwrap();
    let e = other();
    assert!(e.contains("trial 0's folder was started with another config"), "{e}");
}

/// A forecaster trial whose loss goes non-finite (learning rate 1e30) is a diverged row, the
/// sweep goes on and ranks the others, and a second call does not train it again.
#[test]
fn a_diverged_forecaster_trial_is_a_row_not_the_end_of_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let run = std::fs::read_to_string(tiny_seq_config(dir.path(), "mamba2")).unwrap();
    let run: String = run
        .lines()
        .map(|l| match l.strip_prefix('[') {
            Some(rest) => format!("[run.{rest}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let sweep = dir.path().join("sweep.toml");
    let head = "sampler = \"grid\"\nbest = 1\n[space]\n\"seq.lr\" = { choice = [1e30, 0.005] }\n";
    std::fs::write(&sweep, format!("{head}[run]\n{run}")).unwrap();
    let out = dir.path().join("sw");
    let call = || ok(&fx_train().arg("sweep").arg("--config").arg(&sweep).arg("--out").arg(&out).output().unwrap());
    let text = call();
    assert!(text.contains("trial 0 diverged: non-finite"), "{text}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(out.join("trials.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!((rows[0]["status"].as_str(), rows[1]["status"].as_str()), (Some("diverged"), Some("ok")));
    assert_eq!(json_file(&out.join("sweep.json"))["best"][0]["trial"], 1);
    assert!(call().contains("all 2 trials done already"));
}

/// Successive halving (`[halving]`, min_epochs 1, eta 2, 4 epochs: rungs 1, 2, 4) over 6
/// MAMBA-2 trials: the decisions follow the trials' own metrics (recomputed here from their
/// metrics.jsonl), the stopped trials keep the epochs they reached and no report, and a
/// trial trained in pauses ends with the weights of the same trial trained straight
/// through (the schedule is the full run's).
#[test]
fn successive_halving_stops_the_worse_trials_at_rungs() {
    let dir = tempfile::tempdir().unwrap();
    let run =
        std::fs::read_to_string(tiny_seq_config(dir.path(), "mamba2")).unwrap().replace("epochs = 3", "epochs = 4");
    let run: String = run
        .lines()
        .map(|l| match l.strip_prefix('[') {
            Some(rest) => format!("[run.{rest}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let head =
        "trials = 6\nseed = 3\nsampler = \"sobol\"\nbest = 0\n[space]\n\"seq.lr\" = { log_uniform = [1e-3, 2e-2] }\n";
    let (halved, plain) = (dir.path().join("halved.toml"), dir.path().join("plain.toml"));
    std::fs::write(&halved, format!("{head}[halving]\nmin_epochs = 1\neta = 2\n[run]\n{run}")).unwrap();
    std::fs::write(&plain, format!("{head}[run]\n{run}")).unwrap();
    let sweep = |cfg: &Path, out: &Path| {
        ok(&fx_train().arg("sweep").arg("--config").arg(cfg).arg("--out").arg(out).output().unwrap())
    };
    let (h, p) = (dir.path().join("h"), dir.path().join("p"));
    let text = sweep(&halved, &h);
    assert!(
        text.contains("halving at epoch 1: 3 of 6 trials") && text.contains("halving at epoch 2: 2 of 3 trials"),
        "{text}"
    );
    sweep(&plain, &p);
    let trial = |out: &Path, t: usize| out.join(format!("trials/trial-{t}"));
    // The best validation loss of trial t after `epoch` epochs, from its own metrics.
    let best_at = |t: usize, epoch: u64| -> f64 {
        let text = std::fs::read_to_string(trial(&h, t).join("metrics.jsonl")).unwrap();
        let line = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["epoch"] == epoch)
            .unwrap();
        line["best_val_loss"].as_f64().unwrap()
    };
    let best_of = |alive: &[usize], epoch: u64, n: usize| -> Vec<usize> {
        let mut a = alive.to_vec();
        a.sort_by(|&x, &y| best_at(x, epoch).total_cmp(&best_at(y, epoch)).then(x.cmp(&y)));
        a.truncate(n);
        a.sort_unstable();
        a
    };
    let r1 = best_of(&[0, 1, 2, 3, 4, 5], 1, 3);
    let r2 = best_of(&r1, 2, 2);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(h.join("trials.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for r in &rows {
        let t = r["trial"].as_u64().unwrap() as usize;
        let want_epochs = if r2.contains(&t) {
            4
        } else if r1.contains(&t) {
            2
        } else {
            1
        };
        assert_eq!(r["epochs"], want_epochs, "trial {t}: {r}");
        assert_eq!(r["status"], if want_epochs == 4 { "ok" } else { "stopped" }, "trial {t}");
        assert_eq!(trial(&h, t).join("report.json").exists(), want_epochs == 4, "trial {t}");
        assert!(
            checkpoint(&trial(&h, t), want_epochs).exists() && !checkpoint(&trial(&h, t), want_epochs + 1).exists()
        );
    }
    let board = json_file(&h.join("sweep.json"))["leaderboard"].clone();
    assert!(
        r2.contains(&(board[0]["trial"].as_u64().unwrap() as usize))
            && r2.contains(&(board[1]["trial"].as_u64().unwrap() as usize))
    );
    for &t in &r2 {
        assert_eq!(
            tensors(&checkpoint(&trial(&h, t), 4)),
            tensors(&checkpoint(&trial(&p, t), 4)),
            "trial {t} paused twice"
        );
    }
}

// ---------------------------------------------------------------- walk-forward studies

/// The tiny DQN on 1,500 synthetic bars (1,400 feature rows): three folds leave each a
/// 140-row test span after the 101-row purges.
fn study_config(dir: &Path) -> PathBuf {
    let cfg = tiny_config(dir, "dqn", 60, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("bars = 500", "bars = 1500");
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// A study's statistics without the run folders' paths (which name the study folder).
fn study_stats(out: &Path) -> serde_json::Value {
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    for r in doc["runs_table"].as_array_mut().unwrap() {
        r.as_object_mut().unwrap().remove("run");
    }
    doc
}

/// `--warm-start`: each fold after the first starts from its seed's previous fold's last
/// checkpoint (recorded in its config.toml), the first fold trains as without it, and the
/// later folds' results differ from cold starts; without --folds the flag is refused.
#[test]
fn warm_started_folds_start_from_the_previous_fold() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = study_config(dir.path());
    let (cold, warm) = (dir.path().join("cold"), dir.path().join("warm"));
    ok(&train(&cfg, &cold, &["--quiet", "--folds", "2"]));
    let text = ok(&train(&cfg, &warm, &["--quiet", "--folds", "2", "--warm-start"]));
    assert!(text.contains("fold 2/2 seed 7: ") && text.contains("(warm start from the previous fold)"), "{text}");
    let sub = std::fs::read_to_string(warm.join("fold1-seed0/config.toml")).unwrap();
    let want = warm.join("fold0-seed0").join("checkpoint-0000000060.safetensors");
    assert!(sub.contains(&format!("init_from = \"{}\"", want.display())), "{sub}");
    let first = std::fs::read_to_string(warm.join("fold0-seed0/config.toml")).unwrap();
    assert!(!first.contains("init_from"), "{first}");
    let (c, w) = (study_stats(&cold), study_stats(&warm));
    assert_eq!(w["warm_start"], true);
    let sharpe = |d: &serde_json::Value, k: usize| d["runs_table"][k]["sharpe"].as_f64().unwrap();
    assert_eq!(sharpe(&c, 0), sharpe(&w, 0), "fold 0 has nothing to start from");
    let bt = |d: &Path| std::fs::read_to_string(d.join("fold1-seed0/backtest.csv")).unwrap();
    assert_ne!(bt(&cold), bt(&warm), "fold 1 started from fold 0's weights");
    let e = err_line(&train(&cfg, &dir.path().join("x"), &["--quiet", "--warm-start"]));
    assert!(e.contains("--warm-start") && e.contains("--folds"), "{e}");
}

#[test]
fn study_of_folds_and_seeds_reports_its_luck_and_resumes_identically() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = study_config(dir.path());
    let straight = dir.path().join("straight");
    let text = ok(&train(&cfg, &straight, &["--quiet", "--folds", "3", "--seeds", "2", "--prior-trials", "10"]));
    assert!(text.contains("3 fold(s) x 2 seed(s) = 6 dqn runs"), "{text}");
    let doc = study_stats(&straight);
    assert_eq!(doc["runs"], 6);
    assert_eq!(doc["trials_counted"], 12, "2 seeds + 10 prior trials");
    assert_eq!(doc["purge"], 101, "the features' 100-bar look-back plus the one-bar reward");
    let folds = doc["per_fold"].as_array().unwrap();
    assert_eq!(folds.len(), 3);
    let span = |f: &serde_json::Value, k: &str| (f[k]["start"].as_u64().unwrap(), f[k]["end"].as_u64().unwrap());
    for (i, f) in folds.iter().enumerate() {
        let (train, valid, test) = (span(f, "train"), span(f, "valid"), span(f, "test"));
        assert_eq!(train.1 + 101, valid.0, "fold {i}: no training row within the purge of validation");
        assert_eq!(valid.1 + 101, test.0, "fold {i}");
        if i > 0 {
            assert_eq!(span(&folds[i - 1], "test").1, test.0, "test spans tile the end of the rows");
        }
    }
    assert_eq!(span(&folds[2], "test").1, 1400);
    let s = &doc["summary"];
    let (lo, hi, mean) = (
        s["sharpe_mean_ci95"]["lo"].as_f64().unwrap(),
        s["sharpe_mean_ci95"]["hi"].as_f64().unwrap(),
        s["sharpe_mean"].as_f64().unwrap(),
    );
    assert!(lo <= mean && mean <= hi, "{s}");
    let dsr = doc["deflated_sharpe"]["dsr"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&dsr), "{doc}");
    let pbo = doc["probability_of_backtest_overfitting"]["pbo"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&pbo));
    // Every run is an ordinary run folder on its fold's rows, seeds 7 and 8 on one market.
    let sub = std::fs::read_to_string(straight.join("fold2-seed1").join("config.toml")).unwrap();
    assert!(sub.contains("seed = 8") && sub.contains("data_seed = 7") && sub.contains("[rows.test]"), "{sub}");
    let bt = std::fs::read_to_string(straight.join("fold2-seed1").join("backtest.csv")).unwrap();
    assert_eq!(bt.lines().count(), 140, "header + 139 steps over the 140 test rows");

    // Killed in its third run and resumed: the same statistics and the same backtests.
    let killed = dir.path().join("killed");
    let mut child = fx_train()
        .args(["train", "--quiet", "--folds", "3", "--seeds", "2", "--prior-trials", "10", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&killed)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let third = killed.join("fold1-seed0");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !checkpoint(&third, 30).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!killed.join("study.json").exists(), "the study finished before it was killed");
    let text = ok(&resume(&killed));
    assert!(text.contains("(resumed)"), "{text}");
    assert_eq!(study_stats(&killed), doc);
    for f in 0..3 {
        for s in 0..2 {
            let run = format!("fold{f}-seed{s}");
            let a = std::fs::read(straight.join(&run).join("backtest.csv")).unwrap();
            assert!(a == std::fs::read(killed.join(&run).join("backtest.csv")).unwrap(), "{run} differs");
        }
    }
    // A flag that changes the study is refused on resume.
    let e = err_line(&fx_train().args(["train", "--resume", "--folds", "4", "--out"]).arg(&killed).output().unwrap());
    assert!(e.contains("--folds 4 differs from the saved run's 3"), "{e}");
}

/// Forecasters in walk-forward studies: a TFT study of 2 folds x 2 seeds purges the
/// features' look-back plus its horizon H, scores every run by its report's sign strategy
/// (in backtest.csv, as an RL run's) beside its forecast metrics, per run and per fold; a
/// warm-started MAMBA-2 fold starts from the previous fold's checkpoint and ends elsewhere
/// than a cold start, while its first fold is the cold start's.
#[test]
fn forecaster_studies_score_their_forecasts_sign_strategy_and_warm_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_seq_config(dir.path(), "tft");
    let text = std::fs::read_to_string(&cfg).unwrap().replace("bars = 500", "bars = 1500");
    std::fs::write(&cfg, text).unwrap();
    let tft = dir.path().join("tft");
    let text = ok(&train(&cfg, &tft, &["--quiet", "--folds", "2", "--seeds", "2"]));
    assert!(text.contains("2 fold(s) x 2 seed(s) = 4 tft runs") && text.contains("directional accuracy"), "{text}");
    let doc = study_stats(&tft);
    assert_eq!(doc["purge"], 102, "the features' 100-bar look-back plus the TFT's H = 2");
    assert!(doc["strategy"].as_str().unwrap().contains("sign"), "{doc}");
    let fc = &doc["summary"]["forecast"];
    for k in ["directional_accuracy_mean", "rank_correlation_mean", "mse_over_zero_forecast_mean"] {
        assert!(fc[k].as_f64().is_some_and(f64::is_finite), "{k}: {fc}");
    }
    assert!(doc["per_fold"][1]["forecast"]["share_beat_naive_forecasts"].is_number(), "{doc}");
    for r in doc["runs_table"].as_array().unwrap() {
        let run = tft.join(format!("fold{}-seed{}", r["fold"], r["seed"].as_u64().unwrap() - 7));
        let rep = json_file(&run.join("report.json"));
        assert_eq!(r["sharpe"], rep["agent"]["stats"]["sharpe"]);
        assert_eq!(r["forecast"]["directional_accuracy"], rep["forecast"]["directional_accuracy"]);
        let steps = rep["agent"]["stats"]["steps"].as_u64().unwrap() as usize;
        let bt = std::fs::read_to_string(run.join("backtest.csv")).unwrap();
        assert_eq!(bt.lines().count(), steps + 1, "{}: a line per step", run.display());
        let last: usize = bt.lines().last().unwrap().split(',').next().unwrap().parse().unwrap();
        assert!(last + 1 < r["test_rows"]["end"].as_u64().unwrap() as usize, "returns stay inside the test span");
    }
    assert!(doc["deflated_sharpe"]["dsr"].is_number() || doc["deflated_sharpe"]["unavailable"].is_string());
    // The command that started the study resumes it (its flags are the saved study's).
    ok(&train(&cfg, &tft, &["--quiet", "--folds", "2", "--seeds", "2", "--resume"]));
    // Folds too short for a window are refused before the study's folder exists.
    let none = dir.path().join("none");
    let e = err_line(&train(&cfg, &none, &["--quiet", "--folds", "60"]));
    assert!(e.contains("--folds 60") && e.contains("window needs"), "{e}");
    assert!(!none.exists(), "nothing written");

    let cfg = tiny_seq_config(dir.path(), "mamba2");
    // Every epoch's checkpoint kept: the one before fold 1's first epoch is read below.
    let text = std::fs::read_to_string(&cfg).unwrap().replace("bars = 500", "bars = 1500");
    std::fs::write(&cfg, format!("keep_checkpoints = 10\n{text}")).unwrap();
    let (cold, warm) = (dir.path().join("cold"), dir.path().join("warm"));
    ok(&train(&cfg, &cold, &["--quiet", "--folds", "2"]));
    let text = ok(&train(&cfg, &warm, &["--quiet", "--folds", "2", "--warm-start"]));
    assert!(text.contains("(warm start from the previous fold)"), "{text}");
    let sub = std::fs::read_to_string(warm.join("fold1-seed0/config.toml")).unwrap();
    assert!(sub.contains("init_from") && sub.contains("fold0-seed0"), "{sub}");
    let bt = |d: &Path, f: usize| std::fs::read_to_string(d.join(format!("fold{f}-seed0/backtest.csv"))).unwrap();
    assert_eq!(bt(&cold, 0), bt(&warm, 0), "fold 0 has nothing to start from");
    assert_ne!(bt(&cold, 1), bt(&warm, 1), "fold 1 started from fold 0's weights");
    // The warm fold's first checkpoint (before any epoch) holds fold 0's best weights, every
    // tensor byte for byte.
    let bytes = std::fs::read(checkpoint(&warm.join("fold1-seed0"), 0)).unwrap();
    let start = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let last = std::fs::read(checkpoint(&warm.join("fold0-seed0"), 3)).unwrap();
    let prev = safetensors::SafeTensors::deserialize(&last).unwrap();
    let mut n = 0;
    for (name, t) in start.tensors() {
        if let Some(p) = name.strip_prefix("model.") {
            assert_eq!(t.data(), prev.tensor(&format!("best.{p}")).unwrap().data(), "{name}");
            n += 1;
        }
    }
    assert!(n > 3, "{n} weight tensors");
}

// ---------------------------------------------------------------- hostile inputs

/// Paths that are not regular files and flags clap refuses: each ends at once in one line
/// naming what and where, and leaves no run folder behind.
#[cfg(unix)]
#[test]
fn hostile_paths_and_bad_flags_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("bars.csv");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // A symlink to the FIFO: the opener resolves it and refuses the FIFO (never blocks).
    let to_fifo = dir.path().join("to-fifo.csv");
    std::os::unix::fs::symlink(&fifo, &to_fifo).unwrap();
    let looped = dir.path().join("loop.safetensors");
    std::os::unix::fs::symlink(dir.path().join("other"), &looped).unwrap();
    std::os::unix::fs::symlink(&looped, dir.path().join("other")).unwrap();
    let out = dir.path().join("run");
    let data =
        |p: &Path| fx_train().args(["train", "--quiet", "--out"]).arg(&out).arg("--data").arg(p).output().unwrap();
    let t = std::time::Instant::now();
    for (o, want) in [
        (data(&fifo), "bars.csv: is a FIFO (named pipe), not a regular file"),
        (data(&to_fifo), "to-fifo.csv: is a FIFO (named pipe), not a regular file"),
        (data(Path::new("/dev/zero")), "/dev/zero: is a device, not a regular file"),
        (data(&looped), "loop.safetensors: is a symbolic link loop"),
        // A folder is a panel's bars: its FIFO is refused like any input.
        (data(dir.path()), "bars.csv: is a FIFO"),
        (fx_train().args(["train", "--config"]).arg(&fifo).arg("--out").arg(&out).output().unwrap(), "reading config"),
        (
            fx_train()
                .args(["features", "--input"])
                .arg(dir.path())
                .arg("--output")
                .arg(dir.path().join("f"))
                .output()
                .unwrap(),
            // A folder is a panel's bars: its FIFO is refused like any input.
            "bars.csv: is a FIFO",
        ),
    ] {
        let e = err_line(&o);
        assert!(e.contains(want), "{want}: {e}");
        // Said once, not once by the error and again by its cause.
        assert!(e.matches("not a regular file").count() <= 1, "{e}");
    }
    // The same FIFO with a writer that never writes (this process holds both ends).
    let _held = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
    let e = err_line(&data(&fifo));
    assert!(e.contains("bars.csv: is a FIFO (named pipe), not a regular file"), "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(60), "an input blocked");
    assert!(!out.exists(), "a failed start left {} behind", out.display());
    let o = fx_train().args(["train", "--bogus"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = err_line(&o);
    assert!(e.contains("unexpected argument '--bogus'") && e.contains("--help"), "{e}");
    // --help still prints its whole text and succeeds.
    let help = fx_train().args(["train", "--help"]).output().unwrap();
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).lines().count() > 10);
}

/// A feature file whose names are renamed or reordered is refused, not used as if it matched.
#[test]
fn a_feature_file_with_renamed_or_reordered_features_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("f.safetensors");
    ok(&fx_train()
        .args(["features", "--input"])
        .arg(fixtures().join("features_small.csv"))
        .arg("--output")
        .arg(&good)
        .output()
        .unwrap());
    let table = fx_data::FeatureStore::open(&good).unwrap().to_table();
    let mut renamed = table.clone();
    renamed.feature_names[3] = "ret_3_typo".into();
    let mut reordered = table.clone();
    reordered.feature_names.swap(0, 1);
    for (name, t, want) in
        [("renamed", renamed, "market feature 3 is \"ret_3_typo\""), ("reordered", reordered, "market feature 0 is")]
    {
        let path = dir.path().join(format!("{name}.safetensors"));
        t.write(&path).unwrap();
        let e = err_line(
            &fx_train()
                .args(["train", "--quiet", "--data"])
                .arg(&path)
                .arg("--out")
                .arg(dir.path().join(name))
                .output()
                .unwrap(),
        );
        assert!(e.contains(want) && e.contains("DATA.md"), "{name}: {e}");
    }
}

/// Under a 4 GiB address-space limit (a container's), a config sized beyond it is refused
/// in one line naming the key, instead of the allocator aborting the process.
#[cfg(target_os = "linux")]
#[test]
fn configs_beyond_a_memory_limit_are_refused_under_it() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut cmd = fx_train();
    cmd.args(["train", "--quiet", "--num-envs", "20000000", "--out"]).arg(&out);
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            let r = libc::rlimit { rlim_cur: 4 << 30, rlim_max: 4 << 30 };
            if libc::setrlimit(libc::RLIMIT_AS, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let e = err_line(&cmd.output().unwrap());
    assert!(e.contains("env.num_envs needs") && e.contains("address-space limit (4.0 GiB)"), "{e}");
    assert!(!out.exists(), "the refused run left {} behind", out.display());
}

/// `features --input FOLDER` writes the panel of the folder's bar files; a long-format file of
/// the same bars writes the same panel.
#[test]
fn features_of_a_folder_is_a_panel() {
    let dir = tempfile::tempdir().unwrap();
    let bars = dir.path().join("bars");
    std::fs::create_dir(&bars).unwrap();
    for s in ["aapl", "ibm", "msft"] {
        let name = format!("{s}_daily_2000_2013.csv");
        std::fs::copy(fixtures().join("../data").join(&name), bars.join(&name)).unwrap();
    }
    let out = dir.path().join("panel.safetensors");
    let text = ok(&fx_train().args(["features", "--input"]).arg(&bars).arg("--output").arg(&out).output().unwrap());
    assert!(text.contains("panel of 3 instruments x 3170 calendar rows x 51 market features"), "{text}");
    let p = fx_data::Panel::read(&out).unwrap();
    assert_eq!(p.instruments.len(), 3);
    assert!(p.mask.iter().all(|&m| m == 1), "the three stocks share one calendar");
    // The same bars as one long-format file (a symbol column) give the same panel.
    let mut long = String::from("symbol,timestamp,open,high,low,close,volume\n");
    for s in ["aapl", "ibm", "msft"] {
        let text = std::fs::read_to_string(bars.join(format!("{s}_daily_2000_2013.csv"))).unwrap();
        for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            long.push_str(&format!("{s}_daily_2000_2013,{line}\n"));
        }
    }
    let long_path = dir.path().join("long.csv");
    std::fs::write(&long_path, long).unwrap();
    let out2 = dir.path().join("panel2.safetensors");
    let text =
        ok(&fx_train().args(["features", "--input"]).arg(&long_path).arg("--output").arg(&out2).output().unwrap());
    assert!(text.contains("panel of 3 instruments x 3170 calendar rows"), "{text}");
    assert_eq!(fx_data::Panel::read(&out2).unwrap(), p);
    // And as pandas writes them to Parquet (long, zstd, timestamp[ns]; fx-data's tests/data),
    // and as a folder mixing Parquet and CSV bar files.
    let pq = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fx-data/tests/data");
    let out3 = dir.path().join("panel3.safetensors");
    let text = ok(&fx_train()
        .args(["features", "--input"])
        .arg(pq.join("stocks_long.parquet"))
        .arg("--output")
        .arg(&out3)
        .output()
        .unwrap());
    assert!(text.contains("panel of 3 instruments x 3170 calendar rows"), "{text}");
    assert_eq!(fx_data::Panel::read(&out3).unwrap(), p);
    std::fs::remove_file(bars.join("msft_daily_2000_2013.csv")).unwrap();
    std::fs::copy(pq.join("msft_date32.parquet"), bars.join("msft_daily_2000_2013.parquet")).unwrap();
    let out4 = dir.path().join("panel4.safetensors");
    ok(&fx_train().args(["features", "--input"]).arg(&bars).arg("--output").arg(&out4).output().unwrap());
    assert_eq!(fx_data::Panel::read(&out4).unwrap(), p);
}

/// The three shipped stocks as a panel folder, IBM missing 40 bars mid-way (its calendar
/// differs from the others').
fn shipped_panel(dir: &Path) -> PathBuf {
    let bars = dir.join("stocks");
    std::fs::create_dir(&bars).unwrap();
    for s in ["aapl", "ibm", "msft"] {
        let name = format!("{s}_daily_2000_2013.csv");
        let text = std::fs::read_to_string(fixtures().join("../data").join(&name)).unwrap();
        let kept: Vec<&str> =
            text.lines().enumerate().filter(|(i, _)| s != "ibm" || !(2700..2740).contains(i)).map(|(_, l)| l).collect();
        std::fs::write(bars.join(&name), kept.join("\n") + "\n").unwrap();
    }
    bars
}

/// A panel file (memory-mapped; IBM's gap makes it the one instrument gathered into
/// memory) trains exactly as the folder of bars it was made from.
#[test]
fn a_panel_file_trains_as_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let bars = shipped_panel(dir.path());
    let file = dir.path().join("stocks.safetensors");
    ok(&fx_train().args(["features", "--input"]).arg(&bars).arg("--output").arg(&file).output().unwrap());
    let cfg = tiny_config(dir.path(), "dqn", 40, "");
    let (a, b) = (dir.path().join("from-folder"), dir.path().join("from-file"));
    ok(&train(&cfg, &a, &["--quiet", "--data", bars.to_str().unwrap()]));
    ok(&train(&cfg, &b, &["--quiet", "--data", file.to_str().unwrap()]));
    let bt = |d: &Path| std::fs::read_to_string(d.join("backtest.csv")).unwrap();
    assert!(bt(&a).lines().count() > 100);
    assert_eq!(bt(&a), bt(&b));
    let rep = |d: &Path| {
        let mut r = json_file(&d.join("report.json"));
        r.as_object_mut().unwrap().remove("profile");
        r.as_object_mut().unwrap().remove("data_source");
        r
    };
    assert_eq!(rep(&a), rep(&b));
}

/// RL on a panel: DQN and PPO studies of 3 folds x 2 seeds on the three stocks; every run
/// trains on all instruments and reports each instrument and their equal-weight portfolio;
/// the study adds a per-instrument table; a killed DQN study resumes to the same backtests.
#[test]
fn panel_studies_of_folds_and_seeds_report_each_instrument_and_resume_identically() {
    let dir = tempfile::tempdir().unwrap();
    let bars = shipped_panel(dir.path());
    let flags = ["--quiet", "--folds", "3", "--seeds", "2", "--data", bars.to_str().unwrap()];
    for model in ["dqn", "ppo"] {
        let cfg = tiny_config(dir.path(), model, 48, "");
        let out = dir.path().join(format!("{model}-study"));
        let text = ok(&train(&cfg, &out, &flags));
        assert!(text.contains(&format!("3 fold(s) x 2 seed(s) = 6 {model} runs")), "{text}");
        let doc = study_stats(&out);
        let per_instrument = doc["per_instrument"].as_array().unwrap();
        let names: Vec<&str> = per_instrument.iter().map(|i| i["instrument"].as_str().unwrap()).collect();
        assert_eq!(names, ["aapl_daily_2000_2013", "ibm_daily_2000_2013", "msft_daily_2000_2013"]);
        assert!(per_instrument.iter().all(|i| i["runs"] == 6 && i["sharpe_mean"].as_f64().unwrap().is_finite()));
        assert_eq!(doc["per_fold"].as_array().unwrap().len(), 3);
        assert!(doc["deflated_sharpe"]["dsr"].as_f64().is_some(), "{doc}");
        let run = out.join("fold1-seed0");
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
        let inst = rep["instruments"].as_array().unwrap();
        assert_eq!(inst.len(), 3);
        // The portfolio trades on every calendar step of the test span where any
        // instrument does; IBM's gap lies in fold 1's span, so it has fewer steps there.
        let steps: Vec<u64> = inst.iter().map(|i| i["steps"].as_u64().unwrap()).collect();
        let test = rep["test_rows"]["end"].as_u64().unwrap() - rep["test_rows"]["start"].as_u64().unwrap();
        assert_eq!(rep["agent"]["stats"]["steps"].as_u64().unwrap(), test - 1, "{steps:?}");
        assert!(steps[0] == test - 1 && steps[2] == test - 1, "{steps:?}");
        let bt = std::fs::read_to_string(run.join("backtest.csv")).unwrap();
        assert_eq!(bt.lines().count() as u64, test, "header + a line per portfolio step");
        if model == "ppo" {
            continue;
        }
        assert!(steps[1] < test - 1, "IBM gap in fold 1 test span: {steps:?} {}", doc["per_fold"]);
        // Killed in its third run and resumed: the same statistics and backtests.
        let killed = dir.path().join("killed");
        let mut child = fx_train()
            .args(["train", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(&killed)
            .args(flags)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let third = killed.join("fold1-seed0");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !checkpoint(&third, 20).exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!killed.join("study.json").exists(), "the study finished before it was killed");
        let text = ok(&resume(&killed));
        assert!(text.contains("(resumed)"), "{text}");
        assert_eq!(study_stats(&killed), doc);
        for f in 0..3 {
            for s in 0..2 {
                let run = format!("fold{f}-seed{s}");
                let a = std::fs::read(out.join(&run).join("backtest.csv")).unwrap();
                assert!(a == std::fs::read(killed.join(&run).join("backtest.csv")).unwrap(), "{run} differs");
            }
        }
    }
}

/// Forecasters on a panel: a TFT and a MAMBA-2 train on the three stocks' windows at once
/// (built for the panel: the TFT's static context, MAMBA-2's instrument embedding), report
/// pooled and per-instrument forecast metrics and the sign strategy per instrument and as
/// their equal-weight portfolio; eval rescores the same weights; INT8 is refused; a
/// MAMBA-2 study of 2 folds on the panel reports each instrument.
#[test]
fn forecasters_train_on_a_panel_and_report_each_instrument() {
    let dir = tempfile::tempdir().unwrap();
    let bars = shipped_panel(dir.path());
    let names = ["aapl_daily_2000_2013", "ibm_daily_2000_2013", "msft_daily_2000_2013"];
    for model in ["tft", "mamba2"] {
        let run = dir.path().join(format!("{model}-panel"));
        let cfg = tiny_seq_config(dir.path(), model);
        let text = ok(&train(&cfg, &run, &["--quiet", "--epochs", "1", "--data", bars.to_str().unwrap()]));
        assert!(text.contains("pooled over 3 instruments") && text.contains("equal-weight portfolio of 3"), "{text}");
        let rep = json_file(&run.join("report.json"));
        let per = rep["instrument_forecasts"].as_array().unwrap();
        assert_eq!(per.iter().map(|i| i["name"].as_str().unwrap()).collect::<Vec<_>>(), names, "{model}");
        for i in per {
            assert!(i["point"]["mse_model"].as_f64().unwrap().is_finite(), "{model}: {i}");
            assert!(i["target_scale"].as_f64().unwrap() > 0.0);
            assert!(i["forecast"]["n"].as_u64().unwrap() > 100, "{model}: {i}");
        }
        let pooled = rep["forecast"]["n"].as_u64().unwrap();
        assert_eq!(pooled, per.iter().map(|i| i["forecast"]["n"].as_u64().unwrap()).sum::<u64>(), "{model}");
        let legs = rep["instruments"].as_array().unwrap();
        assert_eq!(legs.len(), 3, "{model}");
        let steps = rep["agent"]["stats"]["steps"].as_u64().unwrap();
        assert!(legs.iter().all(|l| l["steps"].as_u64().unwrap() <= steps && l["steps"].as_u64().unwrap() > 100));
        let bt = std::fs::read_to_string(run.join("backtest.csv")).unwrap();
        assert_eq!(bt.lines().count() as u64, steps + 1, "{model}: header + a line per portfolio step");
        let ev = fx_train().args(["eval", "--checkpoint"]).arg(&run).output().unwrap();
        ok(&ev);
        let ev = json_file(&run.join("eval.json"));
        assert_eq!(ev["point"], rep["point"], "{model}");
        assert_eq!(ev["instrument_forecasts"], rep["instrument_forecasts"], "{model}");
        let q = fx_train().args(["quantize", "--checkpoint"]).arg(&run).output().unwrap();
        assert!(!q.status.success());
        let err = String::from_utf8_lossy(&q.stderr);
        assert!(err.contains("panel of 3 instruments") && err.lines().count() == 1, "{model}: {err}");
    }
    let out = dir.path().join("mamba2-study");
    let cfg = tiny_seq_config(dir.path(), "mamba2");
    ok(&train(&cfg, &out, &["--quiet", "--epochs", "1", "--folds", "2", "--data", bars.to_str().unwrap()]));
    let doc = study_stats(&out);
    let per_instrument = doc["per_instrument"].as_array().unwrap();
    assert_eq!(per_instrument.iter().map(|i| i["instrument"].as_str().unwrap()).collect::<Vec<_>>(), names);
    assert_eq!(doc["per_fold"].as_array().unwrap().len(), 2);
}

/// A population study stopped by SIGTERM inside its wave exits 130 with the wave
/// checkpointed in `waves/`, and `--resume` goes on from that env step to the study of the
/// uninterrupted population (on the CPU the same `study.json`).
#[test]
fn a_population_study_stopped_by_sigterm_resumes_inside_its_wave() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), "dqn", 3000, "");
    let flags = ["--quiet", "--folds", "2", "--seeds", "2", "--population"];
    let straight = dir.path().join("straight");
    ok(&train(&cfg, &straight, &flags));
    let stopped = dir.path().join("stopped");
    let mut child = fx_train()
        .args(["train", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&stopped)
        .args(flags)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let seen = lines.by_ref().map_while(|l| l.ok()).find(|l| l.contains("population of 4 runs"));
    assert!(seen.is_some(), "the study never started its population");
    // Into the wave (3000 env steps of 4 members take seconds here).
    std::thread::sleep(std::time::Duration::from_millis(700));
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    assert_eq!(child.wait().unwrap().code(), Some(130), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("population: checkpointed at env step")), "{rest:?}");
    assert!(!stopped.join("fold1-seed1/report.json").exists(), "the wave ended before the signal; make it longer");
    let text = ok(&resume(&stopped));
    let from: u64 = text
        .split("population: goes on from env step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no resume line: {text}"));
    assert!(from > 0 && from < 3000, "a resume inside the wave, from env step {from}");
    assert_eq!(study_stats(&stopped), study_stats(&straight));
    assert!(!stopped.join("waves").exists(), "the wave's checkpoint is removed");
}

/// A study trained as one population (`--population`, a member per fold and seed; DQN in
/// waves of 3 and 1) is the study of runs one after another: on the CPU the same
/// `study.json` and every run's `backtest.csv`, for DQN (on a panel of the three stocks)
/// and PPO (synthetic); its run folders keep their final network and no checkpoint, and
/// `eval` of a member rescores that network to its report's backtest; a forecaster study
/// and a population without a study are refused.
#[test]
fn a_population_study_is_the_study_of_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let bars = shipped_panel(dir.path());
    for (model, data) in [("dqn", Some(bars.to_str().unwrap())), ("ppo", None)] {
        let cfg = tiny_config(dir.path(), model, 64, "");
        let mut flags = vec!["--quiet", "--folds", "2", "--seeds", "2"];
        if let Some(d) = data {
            flags.extend(["--data", d]);
        }
        let (one, pop) = (dir.path().join(format!("{model}-one")), dir.path().join(format!("{model}-pop")));
        ok(&train(&cfg, &one, &flags));
        // DQN in waves of 3 and 1 (FX_POPULATION), PPO in one.
        let waves = if model == "dqn" { "3" } else { "8" };
        let text = ok(&fx_train()
            .args(["train", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(&pop)
            .args(&flags)
            .arg("--population")
            .env("FX_POPULATION", waves)
            .output()
            .unwrap());
        let want =
            if model == "dqn" { "population of 4 runs on cpu in waves of at most 3" } else { "in waves of at most 4" };
        assert!(text.contains(want), "{text}");
        assert!(text.contains("the 2 folds' training series: views of one copy of"), "{text}");
        assert_eq!(study_stats(&pop), study_stats(&one), "{model}");
        for run in ["fold0-seed0", "fold0-seed1", "fold1-seed0", "fold1-seed1"] {
            let bt = |d: &Path| std::fs::read(d.join(run).join("backtest.csv")).unwrap();
            assert!(bt(&pop) == bt(&one), "{model} {run}: backtests differ");
            assert!(pop.join(run).join("weights.safetensors").exists());
            assert!(!checkpoint(&pop.join(run), 64).exists(), "{model} {run}: a member has no checkpoint");
        }
        // eval of a member: its saved network on its fold, the report's backtest again.
        let member = pop.join("fold1-seed1");
        ok(&fx_train().args(["eval", "--checkpoint"]).arg(&member).output().unwrap());
        let (ev, rep) = (json_file(&member.join("eval.json")), json_file(&member.join("report.json")));
        for k in ["agent", "buy_and_hold", "random", "env_steps", "test_rows"] {
            assert_eq!(ev[k], rep[k], "{model}: eval.json's {k}");
        }
        let again = ok(&resume(&pop));
        assert!(!again.contains("population of"), "nothing left to train: {again}");
        assert_eq!(study_stats(&pop), study_stats(&one));
    }
    let seq = tiny_seq_config(dir.path(), "mamba2");
    let out = train(&seq, &dir.path().join("m"), &["--quiet", "--folds", "2", "--population"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--population"));
    let cfg = tiny_config(dir.path(), "dqn", 64, "");
    let out = train(&cfg, &dir.path().join("d"), &["--quiet", "--population"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--folds or --seeds"), "{out:?}");
}
