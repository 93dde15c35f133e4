//! Bad input never panics: valid DQN and PPO trainer state files (weights, optimiser
//! moments, scaler and guard state, the replay buffer, counters and the saved config)
//! damaged by 1–4 random mutations (bytes flipped or overwritten, truncated, garbage
//! appended or inserted, numbers of the JSON header — shapes, offsets, the counters and
//! config in the metadata — replaced by huge, non-finite or out-of-range spellings, text
//! inserted into the header) go through `DqnTrainer::load_state` / `PpoTrainer::load_state`.
//! Each case ends in a trainer or a one-line error, never a panic, an abort or a hang.

/// The fuzzing support every fx-models fuzz test shares (one copy of the module per crate).
#[path = "../../../fx-data/src/fuzz_support.rs"]
pub(crate) mod fz;

use std::path::{Path, PathBuf};

use candle_core::Device;
use fz::Format;

use crate::dqn::trainer::{DqnConfig, DqnTrainer};
use crate::dqn::DqnNetConfig;
use crate::ppo::trainer::{PpoConfig, PpoTrainer};
use crate::ppo::PpoNetConfig;
use crate::synthetic::ar1_env;
use crate::LinearSchedule;

/// A tiny DQN whose replay ring has wrapped and which has taken optimiser steps.
fn dqn_state() -> Vec<u8> {
    let cfg = DqnConfig {
        net: DqnNetConfig { hidden: 8, ..Default::default() },
        batch_size: 8,
        replay_capacity: 24,
        learning_starts: 8,
        epsilon: LinearSchedule { start: 1.0, end: 0.1, steps: 10 },
        seed: 3,
        ..Default::default()
    };
    let mut env = ar1_env(4, 16, 200, 1);
    let mut tr = DqnTrainer::new(cfg, &Device::Cpu).unwrap();
    for _ in 0..7 {
        tr.step(&mut env).unwrap();
    }
    assert!(tr.updates() > 0 && tr.replay().len() == 24 && tr.replay().position() != 0);
    saved(|p| tr.save_state(p), |p| DqnTrainer::load_state(p, &Device::Cpu).map(drop))
}

/// A tiny PPO after one iteration.
fn ppo_state() -> Vec<u8> {
    let cfg = PpoConfig {
        net: PpoNetConfig { hidden: 8, ..Default::default() },
        num_steps: 4,
        epochs: 1,
        minibatch_size: 8,
        seed: 5,
        ..Default::default()
    };
    let mut env = ar1_env(4, 16, 200, 2);
    let mut tr = PpoTrainer::new(cfg, 4, &Device::Cpu).unwrap();
    tr.iterate(&mut env).unwrap();
    saved(|p| tr.save_state(p), |p| PpoTrainer::load_state(p, &Device::Cpu).map(drop))
}

/// The bytes `save` writes, checked to load with `load` undamaged.
fn saved(save: impl FnOnce(&Path) -> crate::Result<()>, load: impl FnOnce(&Path) -> crate::Result<()>) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    save(&path).unwrap();
    load(&path).unwrap_or_else(|e| panic!("the undamaged state does not load: {e}"));
    std::fs::read(&path).unwrap()
}

fn fuzz(reader: &str, input: Vec<u8>, cases: u32, load: fn(PathBuf) -> crate::Result<()>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint-100.safetensors");
    fz::run(reader, cases, fz::mutations(Format::Safetensors), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Safetensors);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.clone();
        let outcome = fz::guarded(move || load(p).map_err(|e| e.to_string()));
        fz::check(reader, outcome, &bytes, None)
    });
}

fn load_dqn(p: PathBuf) -> crate::Result<()> {
    let tr = DqnTrainer::load_state(&p, &Device::Cpu)?;
    std::hint::black_box((tr.config(), tr.replay().len(), tr.updates()));
    Ok(())
}

fn load_ppo(p: PathBuf) -> crate::Result<()> {
    let tr = PpoTrainer::load_state(&p, &Device::Cpu)?;
    std::hint::black_box((tr.config(), tr.iterations(), tr.updates()));
    Ok(())
}

#[test]
fn fuzz_dqn_state_loader() {
    fuzz("DQN state loader", dqn_state(), fz::DEFAULT_CASES, load_dqn);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_dqn_state_loader_long() {
    fuzz("DQN state loader", dqn_state(), fz::long_cases(), load_dqn);
}

#[test]
fn fuzz_ppo_state_loader() {
    fuzz("PPO state loader", ppo_state(), fz::DEFAULT_CASES, load_ppo);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_ppo_state_loader_long() {
    fuzz("PPO state loader", ppo_state(), fz::long_cases(), load_ppo);
}

/// `state` with `from` replaced by `to` in its trainer metadata (the JSON counters and
/// config), the header re-encoded and the tensor data kept.
fn with_metadata_edit(state: &[u8], from: &str, to: &str) -> Vec<u8> {
    let n = u64::from_le_bytes(state[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&state[8..8 + n]).unwrap();
    let meta = header["__metadata__"].as_object_mut().unwrap();
    let (key, value) = meta.iter_mut().find(|(k, _)| k.ends_with("_trainer")).unwrap();
    let text = value.as_str().unwrap();
    assert!(text.contains(from), "{key}: {from} not in {text}");
    *value = serde_json::Value::String(text.replacen(from, to, 1));
    let header = serde_json::to_vec(&header).unwrap();
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&header);
    b.extend_from_slice(&state[8 + n..]);
    b
}

fn load_error(bytes: &[u8], load: fn(PathBuf) -> crate::Result<()>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let msg = fz::guarded(move || load(path).map_err(|e| e.to_string())).unwrap().unwrap_err();
    assert!(!msg.contains('\n') && msg.contains("state.safetensors"), "{msg:?}");
    msg
}

/// Found by `fuzz_dqn_state_loader_long` / `fuzz_ppo_state_loader_long`: the saved
/// config sized the networks before the weights were read, so a damaged width
/// (`"hidden":4460502164236869368`, `"n_actions":17842008656947477474`) overflowed a
/// shape product or a `Vec` capacity (a panic) or failed a huge allocation (an abort
/// that kills the process). The config is now checked against the file's weights first.
#[test]
fn regression_huge_network_in_the_saved_config() {
    let (dqn, ppo) = (dqn_state(), ppo_state());
    for (from, to) in [
        ("\"hidden\":8", "\"hidden\":4460502164236869368"),
        ("\"n_actions\":3", "\"n_actions\":17842008656947477474"),
        ("\"hidden\":8", "\"hidden\":100000"),
    ] {
        let msg = load_error(&with_metadata_edit(&dqn, from, to), load_dqn);
        assert!(msg.contains("the saved config's network needs tensor `online."), "{to}: {msg}");
        let msg = load_error(&with_metadata_edit(&ppo, from, to), load_ppo);
        assert!(msg.contains("the saved config's network needs tensor `model.actor."), "{to}: {msg}");
    }
}

/// Found by `fuzz_dqn_state_loader_long` / `fuzz_ppo_state_loader_long`: a damaged
/// replay capacity or rollout length (`"num_steps":13713862373362351716`) overflowed the
/// buffer's shape (a panic) or asked for terabytes (an abort). Buffers are now checked
/// against the address space and the machine's memory before they are allocated.
#[test]
fn regression_huge_buffers_in_the_saved_config() {
    let dqn = dqn_state();
    for cap in ["4294967295", "18446744073709551615"] {
        let to = format!("\"replay_capacity\":{cap}");
        let msg = load_error(&with_metadata_edit(&dqn, "\"replay_capacity\":24", &to), load_dqn);
        assert!(msg.contains(&format!("the saved replay buffer (replay_capacity {cap})")), "{msg}");
    }
    let ppo = ppo_state();
    for (from, to) in [
        ("\"num_steps\":4", "\"num_steps\":13713862373362351716"),
        ("\"num_steps\":4", "\"num_steps\":1000000000000"),
        ("\"num_envs\":4", "\"num_envs\":4294967296"),
    ] {
        let msg = load_error(&with_metadata_edit(&ppo, from, to), load_ppo);
        assert!(msg.contains("the saved rollout (num_steps "), "{to}: {msg}");
    }
}

/// serde's message for an unknown field quotes its name; a damaged name holding a line
/// end (`"hid\nden"`) would break the one-line error. Also names the file now.
#[test]
fn regression_line_end_in_a_saved_config_field_name() {
    let msg = load_error(&with_metadata_edit(&dqn_state(), "\"hidden\"", "\"hid\\nden\""), load_dqn);
    assert!(msg.contains("`fx.dqn_trainer` metadata is not a DQN trainer state: unknown field `hid\\nden`"), "{msg}");
}
