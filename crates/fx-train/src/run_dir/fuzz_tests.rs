//! Bad input never panics: a valid checkpoint sidecar (`checkpoint-<step>.json`: layout
//! version, model, step count, the training environment's per-account state, the
//! normaliser, the data source, the state file's SHA-256), damaged by 1–4 random mutations
//! (bytes flipped, truncated, lines duplicated, swapped or dropped, numbers replaced by huge,
//! non-finite or out-of-range spellings, text inserted), is looked up as `train --resume`
//! and `eval` look it up (`RunDir::latest_checkpoint`), and a checkpoint that verifies has
//! its normaliser built and its environment state checked against the run's shape. Each
//! case ends in a checkpoint or a one-line error naming the run folder, never a panic or a
//! hang.

use std::path::{Path, PathBuf};

use crate::config::fuzz_tests::fz;
use fz::Format;

use super::{RunDir, RunState, RUN_STATE_VERSION};
use crate::config::ModelChoice;

const ACCOUNTS: usize = 4;
const SERIES: usize = 200;
const EPISODE: usize = 50;

/// A run folder holding one valid checkpoint at step 40; returns the sidecar's bytes.
fn checkpoint(root: &Path) -> Vec<u8> {
    let mut run = RunDir::open(root, false).unwrap();
    super::write_atomic(&root.join("config.toml"), b"model = \"dqn\"\n").unwrap();
    run.mark_started();
    let env = fx_kernels::EnvState {
        t: vec![3, 17, 49, 120],
        pos: vec![-1, 0, 1, 0],
        entry: vec![101.5, 100.0, 99.25, 98.0],
        steps_in_pos: vec![2, 0, 7, 0],
        ep_step: vec![3, 17, 49, 40],
        counter: vec![40, 40, 40, 40],
    };
    let state = RunState {
        version: RUN_STATE_VERSION,
        model: ModelChoice::Dqn,
        env_steps: 40,
        env: Some(env),
        norm_mean: vec![0.1, -0.2, 0.0, 3.5, 1e-3],
        norm_std: vec![1.0, 0.5, 2.0, 0.25, 1e-2],
        data_source: "bars.csv".into(),
        train_seconds: 1.25,
        trainer_sha256: None,
    };
    run.write_checkpoint(&state, 3, |p| super::write_atomic(p, b"trainer state bytes")).unwrap();
    drop(run);
    if let Err(e) = read(root.to_path_buf()) {
        panic!("the undamaged checkpoint does not verify: {e}");
    }
    std::fs::read(root.join("checkpoint-0000000040.json")).unwrap()
}

/// What a resume does with the folder: the newest checkpoint that verifies, its normaliser,
/// its environment state against the run's accounts, series and episode length.
fn read(root: PathBuf) -> Result<(), String> {
    let message = |e: anyhow::Error| format!("{e:#}");
    let run = RunDir::existing(&root).map_err(message)?;
    let Some(c) = run.latest_checkpoint().map_err(message)? else { return Ok(()) };
    c.run.normalizer().map_err(message)?;
    if let Some(env) = &c.run.env {
        env.check(ACCOUNTS, std::slice::from_ref(&(0..SERIES)), EPISODE, "resume")
            .map_err(|e| format!("{}: {e}", c.trainer.display()))?;
    }
    Ok(())
}

fn fuzz(cases: u32) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let input = checkpoint(&root);
    let sidecar = root.join("checkpoint-0000000040.json");
    fz::run("checkpoint sidecar", cases, fz::mutations(Format::Text), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Text);
        std::fs::write(&sidecar, &bytes).unwrap();
        let r = root.clone();
        let outcome = fz::guarded(move || read(r));
        // A damaged sidecar is never moved by a lookup (only `resume_checkpoint` sets aside).
        assert!(sidecar.exists(), "the lookup moved the sidecar");
        fz::check("checkpoint sidecar", outcome, &bytes, Some(root.as_path()))
    });
}

#[test]
fn fuzz_checkpoint_sidecar() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_checkpoint_sidecar_long() {
    fuzz(fz::long_cases());
}
