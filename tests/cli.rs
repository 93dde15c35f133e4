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
