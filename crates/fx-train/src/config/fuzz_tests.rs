//! Bad input never panics: valid run configs (the fully written-out default, as a run
//! folder's `config.toml` holds it, and short hand-written ones) damaged by 1–4 random
//! mutations (bytes flipped, truncated, lines duplicated, swapped or dropped, numbers
//! replaced by huge, non-finite or out-of-range spellings, text inserted) are read with
//! `RunConfig::from_toml_file`, then resolved and written back out as a run does. Each
//! case ends in a config or an error — whose message names the file and, with its causes,
//! folds to the one line `fx-train` prints — never a panic or a hang.

/// The fuzzing support every fx-train fuzz test shares (one copy of the module per crate).
#[path = "../../../fx-data/src/fuzz_support.rs"]
pub(crate) mod fz;

use std::path::PathBuf;

use fz::Format;

use super::{ModelChoice, RunConfig};

fn valid_inputs() -> Vec<Vec<u8>> {
    let full = |model| RunConfig { model, ..RunConfig::default() }.to_toml().unwrap().into_bytes();
    vec![
        full(ModelChoice::Dqn),
        full(ModelChoice::Ppo),
        b"model = \"ppo\"\nsteps = 10\nseed = 3\n\n[env]\nnum_envs = 4\n\n[ppo]\nnum_steps = 8\nminibatch_size = 16\n"
            .to_vec(),
        b"model = \"tft\"\nperiods_per_year = 8760.0\n\n[seq]\nepochs = 2\nlr = 1e-3\n\n[tft]\nd = 8\n".to_vec(),
    ]
}

/// What a run does with a config file: read it, resolve it, write it out (`config.toml`).
/// `Err((true, _))`: reading failed (the message must name the file).
fn read(path: PathBuf) -> Result<(), (bool, String)> {
    let cfg = RunConfig::from_toml_file(&path).map_err(|e| (true, message(&e)))?;
    let cfg = cfg.resolve().map_err(|e| (false, message(&e)))?;
    cfg.to_toml().map(drop).map_err(|e| (false, message(&e)))
}

/// The error as `fx-train` prints it (`main`: the cause chain with multi-line messages,
/// such as TOML snippets, folded); its first part (`{e}`) must itself be one line.
fn message(e: &anyhow::Error) -> String {
    let head = e.to_string();
    if head.contains('\n') {
        return head; // reported as not one line
    }
    let text = format!("{e:#}");
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

fn fuzz(cases: u32) {
    let inputs = valid_inputs();
    for (k, input) in inputs.iter().enumerate() {
        let cfg = RunConfig::from_toml_file(&write_temp(input)).unwrap_or_else(|e| panic!("input {k}: {e:#}"));
        cfg.resolve().unwrap_or_else(|e| panic!("input {k}: {e:#}"));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    fz::run("config loader", cases, (0..inputs.len(), fz::mutations(Format::Text)), |(k, muts)| {
        let bytes = fz::apply(&inputs[k], &muts, Format::Text);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.clone();
        let outcome = fz::guarded(move || read(p));
        let must_name = matches!(outcome, Ok(Err((true, _)))).then_some(path.as_path());
        fz::check("config loader", outcome.map(|r| r.map_err(|(_, e)| e)), &bytes, must_name)
    });
}

fn write_temp(bytes: &[u8]) -> PathBuf {
    let dir = tempfile::tempdir().unwrap().keep();
    let p = dir.join("run.toml");
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn fuzz_config_loader() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_config_loader_long() {
    fuzz(fz::long_cases());
}

fn parse_error(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, text).unwrap();
    let e = RunConfig::from_toml_file(&path).unwrap_err();
    let msg = format!("{e:#}");
    assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg:?}");
    assert!(msg.starts_with(&format!("parsing config {}: ", path.display())), "{msg}");
    msg
}

/// Found by `fuzz_config_loader_long`: the toml crate's parse error is a multi-line
/// snippet quoting the file raw; a stray carriage return (`\rmodel = "dqn"`) survived
/// `fx-train`'s line folding and garbled the printed line. Parse errors are now one line
/// (`line L, column C: what`) with control characters escaped.
#[test]
fn regression_parse_errors_are_one_line() {
    let msg = parse_error("\rmodel = \"dqn\"\n");
    assert!(msg.ends_with(": line 1, column 1: invalid TOML (`\\rmodel = \"dqn\"`)"), "{msg}");
    let msg = parse_error("model = \"dqn\"\n\n[env]\nnum_envs =\n");
    assert!(msg.contains(": line 4, column 11: "), "{msg}");
    let msg = parse_error("model = \"dqn\"\nstepz = 10\n");
    assert!(msg.contains(": line 2, column 1: unknown field `stepz`, expected one of"), "{msg}");
    // A key holding a line end (a TOML escape) is folded like the message's own lines.
    let msg = parse_error("[env]\n\"num\\nenvs\" = 3\n");
    assert!(msg.contains(": line 2, column 1: unknown field `num; envs`"), "{msg}");
}

/// Found reading `check_agent_sizes` beside the fuzz runs (a case needs this exact value
/// in this exact key): the replay memory check's `(2 · state_dim + 3) · 4` overflowed (a
/// panic) for a `dqn.net.state_dim` of `i64::MAX`, the largest TOML integer. Every memory
/// estimate saturates now, and the config is refused (by DQN's own check of the state
/// width, which `resolve` runs before the memory check).
#[test]
fn regression_huge_state_dim_in_the_memory_check() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, "[dqn.net]\nstate_dim = 9223372036854775807\n").unwrap();
    let outcome = fz::guarded(move || {
        let cfg = RunConfig::from_toml_file(&path).map_err(|e| format!("{e:#}"))?;
        // The estimate itself, which `resolve` no longer reaches for this value.
        let most = cfg.host_memory_needs().into_iter().map(|(_, b)| b).max().unwrap_or(0);
        if most != u64::MAX {
            return Err(format!("the network's estimate should saturate, got {most} bytes"));
        }
        cfg.resolve().map(drop).map_err(|e| format!("{e:#}"))
    });
    let msg = outcome.unwrap().expect_err("a state width of i64::MAX is refused");
    assert!(msg.contains("net.state_dim 9223372036854775807 differs from the environment's 56"), "{msg}");
}
