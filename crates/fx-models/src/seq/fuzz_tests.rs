//! Bad input never panics: valid TFT and MAMBA-2 trainer state files (weights, the best
//! epoch's weights, AdamW moments, step counts, the saved training config and epoch log)
//! damaged by 1–4 random mutations (bytes flipped or overwritten, truncated, garbage
//! appended or inserted, numbers of the JSON header — shapes, offsets, the counters and
//! config in the metadata — replaced by huge, non-finite or out-of-range spellings, text
//! inserted into the header) go through `SeqTrainer::load_state`, as `train --resume` loads
//! them. Each case ends in a restored trainer or a one-line error naming the file, never a
//! panic, an abort or a hang.

use crate::state_meta::fuzz_tests::fz;

use std::path::PathBuf;

use candle_core::Device;
use fz::Format;

use super::{Mamba2Task, SeqSeries, SeqTask, SeqTrainConfig, SeqTrainer};
use crate::{Mamba2, Mamba2Config, Tft, TftConfig};

const ROWS: usize = 90;
const TRAIN: std::ops::Range<usize> = 0..60;
const VALID: std::ops::Range<usize> = 60..90;

fn series() -> SeqSeries {
    let u = |n: usize, stream: u64| -> Vec<f32> {
        (0..n as u64).map(|i| (fx_kernels::rng::draw(21, stream, 0, i) * 2.0 - 1.0) as f32).collect()
    };
    SeqSeries::new(u(ROWS * 3, 1), 3, u(ROWS * 2, 2), 2, u(ROWS, 3)).unwrap()
}

fn cfg() -> SeqTrainConfig {
    SeqTrainConfig { epochs: 3, batch_size: 8, lr: 5e-3, patience: 5, ..Default::default() }
}

fn tft() -> Tft {
    let c = TftConfig { n_observed: 3, n_known: 2, d: 8, n_head: 2, l_enc: 6, h: 2, ..TftConfig::default() };
    Tft::new(c, &Device::Cpu, 3).unwrap()
}

fn mamba2() -> Mamba2 {
    let c = Mamba2Config {
        n_in: 3,
        d_model: 8,
        n_layer: 1,
        expand: 2,
        d_state: 4,
        headdim: 4,
        ngroups: 1,
        d_conv: 4,
        chunk_size: 8,
        norm_eps: 1e-5,
    };
    Mamba2::new(c, &Device::Cpu, 3).unwrap()
}

/// The state after one epoch (best weights recorded), checked to load undamaged.
fn state_of(task: &impl SeqTask, load: fn(PathBuf) -> crate::Result<()>) -> Vec<u8> {
    let mut tr = SeqTrainer::new(task, TRAIN, &cfg()).unwrap();
    tr.train_epoch(task, &series(), VALID).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint-1.safetensors");
    tr.save_state(task, &path).unwrap();
    load(path.clone()).unwrap_or_else(|e| panic!("the undamaged state does not load: {e}"));
    std::fs::read(&path).unwrap()
}

/// A fresh model and trainer, restored from `p` (what `train --resume` does).
fn load_tft(p: PathBuf) -> crate::Result<()> {
    let model = tft();
    let mut tr = SeqTrainer::new(&model, TRAIN, &cfg())?;
    tr.load_state(&model, &p)?;
    std::hint::black_box((tr.epochs_done(), tr.log().len()));
    Ok(())
}

fn load_mamba2(p: PathBuf) -> crate::Result<()> {
    let model = mamba2();
    let task = Mamba2Task { model: &model, seq_len: 8 };
    let mut tr = SeqTrainer::new(&task, TRAIN, &cfg())?;
    tr.load_state(&task, &p)?;
    std::hint::black_box((tr.epochs_done(), tr.log().len()));
    Ok(())
}

fn tft_state() -> Vec<u8> {
    state_of(&tft(), load_tft)
}

fn mamba2_state() -> Vec<u8> {
    let model = mamba2();
    state_of(&Mamba2Task { model: &model, seq_len: 8 }, load_mamba2)
}

fn fuzz(reader: &str, input: Vec<u8>, cases: u32, load: fn(PathBuf) -> crate::Result<()>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint-7.safetensors");
    fz::run(reader, cases, fz::mutations(Format::Safetensors), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Safetensors);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.clone();
        let outcome = fz::guarded(move || load(p).map_err(|e| e.to_string()));
        fz::check(reader, outcome, &bytes, Some(path.as_path()))
    });
}

#[test]
fn fuzz_tft_state_loader() {
    fuzz("TFT state loader", tft_state(), fz::DEFAULT_CASES, load_tft);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_tft_state_loader_long() {
    fuzz("TFT state loader", tft_state(), fz::long_cases(), load_tft);
}

#[test]
fn fuzz_mamba2_state_loader() {
    fuzz("MAMBA-2 state loader", mamba2_state(), fz::DEFAULT_CASES, load_mamba2);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_mamba2_state_loader_long() {
    fuzz("MAMBA-2 state loader", mamba2_state(), fz::long_cases(), load_mamba2);
}
