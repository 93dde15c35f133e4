//! Writes fx-saved weights for the PyTorch round-trip check (`tools/torch_roundtrip_check.py`).
//!
//! Usage: `cargo run -p fx-models --example export_for_torch -- OUT_DIR`. Writes, for DQN
//! and PPO (h = 64): the parity fixture's weights loaded into fx and saved by fx
//! (`{dqn,ppo}_from_fixture.safetensors`), a fresh fx-initialised network
//! (`{dqn,ppo}_fx_init.safetensors`) and fx's outputs of that network on the fixture's
//! input (`{dqn,ppo}_fx_init_out.safetensors`), so PyTorch can load fx's files with
//! `strict=True` and reproduce fx's numbers.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::Device;
use fx_models::{ActorCritic, DqnNetConfig, DuelingDqn, PpoNetConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::args().nth(1).ok_or("usage: export_for_torch OUT_DIR")?);
    std::fs::create_dir_all(&out)?;
    let fixtures = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures"));
    let dev = Device::Cpu;

    let fx = fx_models::params::read_safetensors(&fixtures.join("dqn.safetensors"), &dev)?;
    let cfg = DqnNetConfig { hidden: 64, ..Default::default() };
    let net = DuelingDqn::new(cfg, &dev, 1)?;
    net.params().assign_from(&fx, "dqn.safetensors", "", false)?;
    net.save(&out.join("dqn_from_fixture.safetensors"))?;
    let fresh = DuelingDqn::new(cfg, &dev, 42)?;
    fresh.save(&out.join("dqn_fx_init.safetensors"))?;
    let q = fresh.forward_inference(&fx["in.obs"])?;
    fx_models::params::write_safetensors(
        &HashMap::from([("q".to_string(), q)]),
        &out.join("dqn_fx_init_out.safetensors"),
    )?;

    let fx = fx_models::params::read_safetensors(&fixtures.join("ppo.safetensors"), &dev)?;
    let cfg = PpoNetConfig { hidden: 64, ..Default::default() };
    let m = ActorCritic::new(cfg, &dev, 1)?;
    m.params().assign_from(&fx, "ppo.safetensors", "", false)?;
    m.save(&out.join("ppo_from_fixture.safetensors"))?;
    let fresh = ActorCritic::new(cfg, &dev, 43)?;
    fresh.save(&out.join("ppo_fx_init.safetensors"))?;
    let (logits, value) = fresh.forward_inference(&fx["in.obs"])?;
    fx_models::params::write_safetensors(
        &HashMap::from([("logits".to_string(), logits), ("value".to_string(), value)]),
        &out.join("ppo_fx_init_out.safetensors"),
    )?;
    println!("wrote 6 files to {}", out.display());
    Ok(())
}
