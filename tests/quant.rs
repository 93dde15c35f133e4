//! `fx-train quantize` and `fx-train eval --int8` end to end: a short run at the default
//! network size, its INT8 policy, the report's accuracy and size claims, the file's
//! layout as another reader sees it, and one-line errors; issue 13's accuracy bars on the
//! default DQN and PPO runs and on AAPL's bars (about 100 s on two cores).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fx_train() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fx-train"));
    cmd.env_remove("FX_DEVICE").env_remove("FX_PRECISION").env_remove("FX_BATCH_SIZE");
    cmd
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn err_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected failure: {}", String::from_utf8_lossy(&out.stdout));
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(err.lines().count(), 1, "expected a one-line error, got {err:?}");
    err
}

fn json_file(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A short run with the default network (h = 256) on a 3,000-bar synthetic market (450
/// test rows), small enough for a test.
fn short_run(dir: &Path, model: &str) -> PathBuf {
    let cfg = dir.join(format!("{model}.toml"));
    std::fs::write(
        &cfg,
        format!(
            r#"model = "{model}"
steps = 300
checkpoint_every = 300
log_every = 100
device = "cpu"
[synthetic]
bars = 3000
[env]
num_envs = 8
episode_len = 64
[dqn]
batch_size = 64
replay_capacity = 4000
learning_starts = 256
[ppo]
num_steps = 32
epochs = 2
minibatch_size = 64
"#
        ),
    )
    .unwrap();
    let run = dir.join(model);
    ok(&fx_train().args(["train", "--quiet", "--config"]).arg(&cfg).arg("--out").arg(&run).output().unwrap());
    run
}

fn int8_file(run: &Path) -> PathBuf {
    let mut f: Vec<PathBuf> = std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".int8.safetensors"))
        .collect();
    assert_eq!(f.len(), 1, "{f:?}");
    f.remove(0)
}

#[test]
fn quantize_and_eval_int8_for_dqn_and_ppo() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["dqn", "ppo"] {
        let run = short_run(dir.path(), model);
        let out = fx_train().args(["quantize", "--checkpoint"]).arg(&run).output().unwrap();
        let text = ok(&out);
        assert!(text.contains("greedy action equal to F32"), "{text}");
        let rep = json_file(&run.join("quant_report.json"));
        let agree = rep["action_agreement"].as_f64().unwrap();
        // Below the 99% target the command says so (and only then).
        let warned = String::from_utf8_lossy(&out.stderr).contains("below the 99% target");
        assert_eq!(
            warned,
            agree < 0.99,
            "{model}: agreement {agree}, stderr {:?}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Issue 13's target is 0.99; this 300-step run's near-tie Q values (max |Q| 0.17)
        // reach 0.982 for the DQN with dynamic scales (0.963 with min-max; docs/QUANT.md,
        // "Accuracy"): the bound here guards against regressions, the report states the target.
        assert!(agree >= 0.95, "{model}: INT8 agrees with F32 on only {agree} of test observations: {rep}");
        assert!(rep["test_rows"].as_u64().unwrap() >= 400, "{rep}");
        // The guarded policy (F32 on near-ties, the file's margin) meets the target, asking
        // F32 on a minority of decisions.
        let margin = rep["decision_margin"].as_f64().unwrap();
        assert!(margin > 0.0 && margin.is_finite(), "{rep}");
        assert!(rep["guarded_action_agreement"].as_f64().unwrap() >= 0.99, "{model}: {rep}");
        let share = rep["guarded_f32_share"].as_f64().unwrap();
        assert!((0.0..0.5).contains(&share), "{model}: {rep}");
        eprintln!("{model}: plain {agree}, guarded {}, F32 share {share}", rep["guarded_action_agreement"]);
        assert!(rep["size_ratio"].as_f64().unwrap() >= 3.5, "{rep}");
        assert!(rep["max_abs_score_diff"].as_f64().unwrap() > 0.0, "{rep}");
        // 2048 asked for; the greedy replay of this short training split yields slightly fewer.
        let rows = rep["calibration"]["rows"].as_u64().unwrap();
        assert!((1000..=2048).contains(&rows), "{rep}");
        assert_eq!(rep["format"], "fx-int8/1");

        // The file as any safetensors reader sees it: I8 weights under the spec's names,
        // F32 scales, the metadata.
        let path = int8_file(&run);
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap();
        assert_eq!(meta["format"], "fx-int8/1");
        assert_eq!(meta["model"], model);
        assert_eq!(meta["source_sha256"].len(), 64);
        assert_eq!(meta["calibration_method"], "dynamic");
        assert_eq!(meta["decision_margin"].parse::<f64>().unwrap() as f32, margin as f32);
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let first = if model == "dqn" { "trunk.0" } else { "actor.0" };
        let w = st.tensor(&format!("{first}.weight")).unwrap();
        assert_eq!((w.dtype(), w.shape()), (safetensors::Dtype::I8, &[256usize, 56][..]));
        let s = st.tensor(&format!("{first}.weight_scale")).unwrap();
        assert_eq!((s.dtype(), s.shape()), (safetensors::Dtype::F32, &[256usize][..]));
        assert_eq!(st.tensor(&format!("{first}.input_scale")).unwrap().shape(), &[1]);

        let out = fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&run).output().unwrap();
        let text = ok(&out);
        assert!(text.contains("INT8") && text.contains("Sharpe F32"), "{text}");
        let ev = json_file(&run.join("eval_int8.json"));
        for k in ["sharpe_f32", "sharpe_int8", "sharpe_rel_diff", "position_agreement"] {
            assert!(ev[k].as_f64().is_some_and(f64::is_finite), "{model}: {k} in {ev}");
        }
        // Issue 13's bar is a Sharpe within 2% of F32's; this short run misses it for the DQN
        // (see docs/QUANT.md), and the command must say so whenever it is missed.
        assert!(ev["position_agreement"].as_f64().unwrap() >= 0.9, "{ev}");
        // Guarded, issue 13's bars hold: the same positions as F32 on at least 99% of bars and
        // a Sharpe within 2%.
        assert!(ev["position_agreement_guarded"].as_f64().unwrap() >= 0.99, "{model}: {ev}");
        assert!(ev["sharpe_rel_diff_guarded"].as_f64().unwrap() <= 0.02, "{model}: {ev}");
        eprintln!(
            "{model}: Sharpe rel diff plain {}, guarded {}",
            ev["sharpe_rel_diff"], ev["sharpe_rel_diff_guarded"]
        );
        let rel = ev["sharpe_rel_diff"].as_f64().unwrap();
        let warned = String::from_utf8_lossy(&out.stderr).contains("away from F32's");
        assert_eq!(warned, rel > 0.02, "{model}: Sharpe rel diff {rel}");
    }

    // A changed F32 checkpoint (here: another run's state copied over it, sidecar and all)
    // no longer matches the INT8 file's source hash.
    let (dqn, ppo) = (dir.path().join("dqn"), dir.path().join("ppo"));
    let int8 = int8_file(&dqn);
    let trainer = PathBuf::from(int8.to_string_lossy().replace(".int8.safetensors", ".safetensors"));
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    for e in std::fs::read_dir(&dqn).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, other.join(p.file_name().unwrap())).unwrap();
    }
    let mut bytes = std::fs::read(&trainer).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(other.join(trainer.file_name().unwrap()), &bytes).unwrap();
    let sidecar = other.join(trainer.file_name().unwrap()).with_extension("json");
    let mut side = json_file(&sidecar);
    side["trainer_sha256"] = serde_json::Value::Null;
    std::fs::write(&sidecar, side.to_string()).unwrap();
    let e = err_line(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&other).output().unwrap());
    assert!(e.contains("SHA-256") && e.contains("fx-train quantize"), "{e}");

    // No INT8 file yet, a bad method, a sequence-model run: one-line errors.
    std::fs::remove_file(int8_file(&ppo)).unwrap();
    let e = err_line(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&ppo).output().unwrap());
    assert!(e.contains("no INT8 policy") && e.contains("fx-train quantize"), "{e}");
    let e = err_line(
        &fx_train()
            .args(["quantize", "--method", "percentile", "--percentile", "0", "--checkpoint"])
            .arg(&ppo)
            .output()
            .unwrap(),
    );
    assert!(e.contains("percentile"), "{e}");
    let e =
        err_line(&fx_train().args(["quantize", "--f32-layers", "trunk.9", "--checkpoint"]).arg(&dqn).output().unwrap());
    assert!(e.contains("trunk.9"), "{e}");
}

/// Issue 13's accuracy bars on the runs it names: the main job's default DQN and PPO
/// (`fx-train train` with the embedded default config, synthetic market) and both on AAPL's
/// daily bars (`../shared/data`). Guarded INT8 (the policy `quantize` recommends for the DQN,
/// whose near-tie Q values flip plain INT8 actions: docs/QUANT.md) decides like F32 on at
/// least 99 % of test rows with a Sharpe within 2 %; the PPO's plain INT8 does too; every
/// file is at least 3.5× smaller than F32.
#[test]
fn int8_accuracy_bars_on_the_default_and_aapl_runs() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["dqn", "ppo"] {
        for data in [None, Some(AAPL)] {
            let run = dir.path().join(format!("{model}-{}", if data.is_some() { "aapl" } else { "default" }));
            let mut train = fx_train();
            train.args(["train", "--quiet", "--device", "cpu", "--model", model, "--out"]).arg(&run);
            if let Some(d) = data {
                train.args(["--data", d]);
            }
            ok(&train.output().unwrap());
            ok(&fx_train().args(["quantize", "--checkpoint"]).arg(&run).output().unwrap());
            ok(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&run).output().unwrap());
            let (rep, ev) = (json_file(&run.join("quant_report.json")), json_file(&run.join("eval_int8.json")));
            let name = run.file_name().unwrap().to_string_lossy().into_owned();
            eprintln!(
                "{name}: agreement plain {} guarded {}, Sharpe rel diff plain {} guarded {}",
                rep["action_agreement"],
                rep["guarded_action_agreement"],
                ev["sharpe_rel_diff"],
                ev["sharpe_rel_diff_guarded"]
            );
            assert!(rep["size_ratio"].as_f64().unwrap() >= 3.5, "{name}: {rep}");
            assert!(rep["guarded_action_agreement"].as_f64().unwrap() >= 0.99, "{name}: {rep}");
            assert!(ev["sharpe_rel_diff_guarded"].as_f64().unwrap() <= 0.02, "{name}: {ev}");
            if model == "ppo" {
                assert!(rep["action_agreement"].as_f64().unwrap() >= 0.99, "{name}: {rep}");
                assert!(ev["sharpe_rel_diff"].as_f64().unwrap() <= 0.02, "{name}: {ev}");
            }
        }
    }
}

/// The `[seq]` table of the short sequence runs.
const SHORT_SEQ: &str = "[seq]\nepochs = 3\nbatch_size = 32\nlr = 0.005\npatience = 5\n";

/// AAPL's daily bars, from the crate's folder (where the tests run).
const AAPL: &str = "../../../shared/data/aapl_daily_2000_2013.csv";

/// A short sequence-model run `dir/name` on the CPU: top-level keys `top`, 1,500 synthetic
/// bars, the model's tables `tables` and [`SHORT_SEQ`]; on real bars with `data`.
fn short_seq_run(dir: &Path, name: &str, top: &str, tables: &str, data: Option<&str>) -> PathBuf {
    let cfg = dir.join(format!("{name}.toml"));
    let text = format!("{top}device = \"cpu\"\n[synthetic]\nbars = 1500\n{tables}{SHORT_SEQ}");
    std::fs::write(&cfg, text).unwrap();
    let run = dir.join(name);
    let mut cmd = fx_train();
    cmd.args(["train", "--quiet", "--config"]).arg(&cfg).arg("--out").arg(&run);
    if let Some(d) = data {
        cmd.args(["--data", d]);
    }
    ok(&cmd.output().unwrap());
    run
}

/// A short TFT run (width 16); see [`short_seq_run`].
fn short_tft_run(dir: &Path, name: &str, data: Option<&str>) -> PathBuf {
    let tables = "[tft]\nd = 16\nn_head = 2\nL_enc = 16\nH = 2\ndropout = 0.0\n";
    short_seq_run(dir, name, "model = \"tft\"\n", tables, data)
}

/// Issue 13's TFT half end to end, on synthetic bars and on AAPL's daily bars: `quantize`
/// writes the INT8 file (every weight matrix I8 under its spec name) and a report whose
/// test-split pinball loss is within 1 % of F32's and coverage within one point, for the
/// default (dynamic) and the percentile method; `eval --int8` scores the file again; a
/// MAMBA-2 run and --f32-layers on a TFT run are one-line errors.
#[test]
fn quantize_and_eval_int8_for_tft() {
    let dir = tempfile::tempdir().unwrap();
    for (name, data) in [("tft", None), ("tft-aapl", Some(AAPL))] {
        let run = short_tft_run(dir.path(), name, data);
        for method in ["dynamic", "percentile"] {
            let text =
                ok(&fx_train().args(["quantize", "--method", method, "--checkpoint"]).arg(&run).output().unwrap());
            assert!(text.contains("TFT matrices INT8") && text.contains("mean pinball loss"), "{text}");
            let r = json_file(&run.join("quant_report.json"));
            assert_eq!(r["model"], "tft");
            assert_eq!(r["calibration"]["method"], method);
            assert_eq!(r["calibration"]["rows"], 256);
            let rel = r["pinball_rel_diff"].as_f64().unwrap();
            let cov = r["coverage_diff_points"].as_f64().unwrap();
            eprintln!("{name} {method}: pinball {rel:.5} apart, coverage {cov:+.3} points");
            assert!(rel <= 0.01, "{name} {method}: pinball {rel}");
            assert!(cov.abs() <= 1.0, "{name} {method}: coverage {cov}");
            assert!(r["f32"]["n"].as_u64().unwrap() > 100 && r["size_ratio"].as_f64().unwrap() > 2.5, "{r}");
        }
        let file = int8_file(&run);
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("enc_vsn.vars.7.glu.fc4.weight").unwrap().dtype(), safetensors::Dtype::I8);
        assert_eq!(st.tensor("lstm_enc.weight_hh_l0").unwrap().dtype(), safetensors::Dtype::I8);
        assert_eq!(st.tensor("lstm_enc.input_hh_l0_scale").unwrap().shape(), &[1]);
        assert_eq!(st.tensor("post_attn_norm.weight").unwrap().dtype(), safetensors::Dtype::F32);
        let text = ok(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&run).output().unwrap());
        assert!(text.contains("eval_int8.json"), "{text}");
        let e = json_file(&run.join("eval_int8.json"));
        assert_eq!(e["mean_pinball_int8"], json_file(&run.join("quant_report.json"))["mean_pinball_int8"]);
    }
    let run = dir.path().join("tft");
    let e =
        err_line(&fx_train().args(["quantize", "--f32-layers", "head", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("--f32-layers") && e.contains("tft"), "{e}");
}

/// The MAMBA-2 half: `quantize` and `eval --int8` on a short run (synthetic bars and AAPL's
/// daily bars) feed every bar through the F32 and the INT8 one-bar step and report the test
/// split's forecast MSE of both, within 1 % (issue 13's MAMBA-2 target); no file is written
/// (the step quantises when built), and calibration flags are refused in one line.
#[test]
fn quantize_and_eval_int8_for_mamba2() {
    let dir = tempfile::tempdir().unwrap();
    let top = "model = \"mamba2\"\nmamba2_seq_len = 32\n";
    let tables = "[mamba2]\nd_model = 32\nn_layer = 2\nd_state = 8\nheaddim = 8\nchunk_size = 8\n";
    for (name, data) in [("m2", None), ("m2-aapl", Some(AAPL))] {
        let run = short_seq_run(dir.path(), name, top, tables, data);
        let text = ok(&fx_train().args(["quantize", "--checkpoint"]).arg(&run).output().unwrap());
        assert!(text.contains("forecast MSE F32") && text.contains("INT8"), "{text}");
        let r = json_file(&run.join("quant_report.json"));
        let rel = r["mse_rel_diff"].as_f64().unwrap();
        eprintln!("{name}: INT8 MSE {rel:.5} apart from F32 over {} test bars", r["test_bars"]);
        assert!(rel <= 0.01 && r["test_bars"].as_u64().unwrap() > 100, "{r}");
        // (A quarter of the bytes at the default size; rows padded to 64 inputs weigh more here.)
        assert!(
            r["projection_bytes_int8"].as_f64().unwrap() * 2.0 < r["projection_bytes_f32"].as_f64().unwrap(),
            "{r}"
        );
        assert!(std::fs::read_dir(&run).unwrap().all(|e| !e.unwrap().path().to_string_lossy().contains(".int8.")));
        ok(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&run).output().unwrap());
        assert_eq!(json_file(&run.join("eval_int8.json"))["mse_int8"], r["mse_int8"]);
    }
    let run = dir.path().join("m2");
    let e = err_line(&fx_train().args(["quantize", "--method", "minmax", "--checkpoint"]).arg(&run).output().unwrap());
    assert!(e.contains("dynamic") && e.contains("mamba2"), "{e}");
}

/// Whether process `pid` catches `signal` (its `SigCgt` mask in /proc): a signal sent
/// before the handler is installed would kill the process whatever the handler does.
fn catches(pid: u32, signal: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).map(str::trim).unwrap_or("0");
    u64::from_str_radix(mask, 16).is_ok_and(|m| m & (1 << (signal - 1)) != 0)
}

/// `quantize` under SIGTERM (what a scheduler sends) stops like the trainer: exit 130 with
/// the INT8 file written whole or not at all and no temporary left beside it. Signalled at
/// several points of its work, each once its handler is in place.
#[test]
fn quantize_stops_on_sigterm_with_the_whole_file_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let run = short_run(dir.path(), "dqn");
    let listing = |run: &Path| -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(run).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    };
    let before = listing(&run);
    let (mut stopped_before, mut stopped_after) = (0, 0);
    for delay_ms in [0u64, 20, 60, 150, 400] {
        let child = fx_train()
            .args(["quantize", "--checkpoint"])
            .arg(&run)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        while !catches(child.id(), 15) {
            assert!(t.elapsed() < std::time::Duration::from_secs(20), "quantize never installed its handler");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // 0 only when the signal came after the command's last check (its work was done).
        assert!(matches!(out.status.code(), Some(130) | Some(0)), "delay {delay_ms} ms: {:?} {stderr}", out.status);
        let after = listing(&run);
        let new: Vec<&String> = after.iter().filter(|n| !before.contains(n)).collect();
        if stdout.contains("nothing was written") {
            assert_eq!(out.status.code(), Some(130));
            assert!(new.is_empty(), "delay {delay_ms} ms: an interrupted quantize left {new:?}");
            stopped_before += 1;
        } else {
            // Written whole: the loader's checks (its own SHA-256 included) pass.
            assert!(new.iter().all(|n| n.ends_with(".int8.safetensors") || n == &"quant_report.json"), "{new:?}");
            ok(&fx_train().args(["eval", "--int8", "--checkpoint"]).arg(&run).output().unwrap());
            stopped_after += 1;
            // Back to the folder as it was (the eval's report included) for the next signal.
            for n in listing(&run).iter().filter(|n| !before.contains(n)) {
                std::fs::remove_file(run.join(n)).unwrap();
            }
        }
    }
    // The earliest signal always lands before the file is written (calibration takes longer
    // than the handler's installation); later ones may land either side.
    assert!(stopped_before >= 1, "no signal stopped quantize before its write ({stopped_after} after)");
}
