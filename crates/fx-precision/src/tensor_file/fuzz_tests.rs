//! Bad input never panics: a valid checkpoint (weights, AdamW moments and step counts,
//! GradScaler and guard metadata) damaged by 1–4 random mutations (bytes flipped or
//! overwritten, truncated, garbage appended or inserted, numbers of the JSON header —
//! shapes, offsets, metadata values — replaced by huge, non-finite or out-of-range
//! spellings, text inserted into the header) is loaded and restored into a model and its
//! optimiser, as a resume does. Each case ends in a restored state or a one-line error
//! (naming the file when the file itself cannot be read), never a panic or a hang.

#[path = "../../../fx-data/src/fuzz_support.rs"]
mod fz;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder, VarMap};
use fz::Format;

use super::{load_tensors, save_tensors_atomic, varmap_tensors};
use crate::grad_scaler::GradScaler;
use crate::guard::TrainStep;
use crate::optim::{sorted_vars, AdamW, AdamWConfig};
use crate::precision::Precision;

/// A two-tensor model and its guarded AdamW (F16 loss scaling, so the scaler state is real).
fn model() -> (VarMap, TrainStep<AdamW>) {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    vb.pp("l").get_with_hints((4, 3), "weight", Init::Const(0.5)).unwrap();
    vb.pp("l").get_with_hints(4, "bias", Init::Const(-0.25)).unwrap();
    let opt = AdamW::new(sorted_vars(&vm), AdamWConfig::default()).unwrap();
    let step = TrainStep::new(opt, GradScaler::for_precision(Precision::F16), Some(1.0)).unwrap();
    (vm, step)
}

/// The bytes of a valid checkpoint after two optimiser steps.
fn valid_input() -> Vec<u8> {
    let (vm, mut step) = model();
    for _ in 0..2 {
        let loss = sorted_vars(&vm)
            .iter()
            .map(|(_, v)| v.as_tensor().sqr().and_then(|t| t.sum_all()).unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap();
        step.step(&loss).unwrap();
    }
    let mut tensors = varmap_tensors(&vm, "model.");
    let mut meta = HashMap::from([("note".to_string(), "fuzz base".to_string())]);
    step.save_state(&mut tensors, &mut meta, "opt.").unwrap();
    tensors.insert("counter".into(), Tensor::new(12i64, &Device::Cpu).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("base.safetensors");
    save_tensors_atomic(&path, &tensors, &meta).unwrap();
    restore(&path).unwrap_or_else(|(_, e)| panic!("the undamaged checkpoint does not restore: {e}"));
    std::fs::read(&path).unwrap()
}

/// A resume's reads: the file, then the weights, the optimiser and the counter, then the
/// check that nothing is left over. `Err((true, _))`: the file itself could not be read.
fn restore(path: &Path) -> Result<(), (bool, String)> {
    let mut nt = load_tensors(path, &Device::Cpu).map_err(|e| (true, e.to_string()))?;
    let later = |e: crate::Error| (false, e.to_string());
    let (vm, mut step) = model();
    nt.restore_varmap(&vm, "model.").map_err(later)?;
    step.load_state(&mut nt, "opt.").map_err(later)?;
    let c = nt.take("counter", &[]).map_err(later)?;
    c.to_dtype(DType::I64).and_then(|c| c.to_scalar::<i64>()).map_err(|e| (false, e.to_string()))?;
    nt.finish().map_err(later)
}

fn fuzz(cases: u32) {
    let input = valid_input();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint-100.safetensors");
    fz::run("checkpoint loader", cases, fz::mutations(Format::Safetensors), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Safetensors);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.clone();
        let outcome = fz::guarded(move || restore(&p));
        // Errors reading the file name it; later ones name the tensor or metadata key.
        let must_name = matches!(outcome, Ok(Err((true, _)))).then_some(path.as_path());
        fz::check("checkpoint loader", outcome.map(|r| r.map_err(|(_, e)| e)), &bytes, must_name)
    });
}

#[test]
fn fuzz_checkpoint_loader() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_checkpoint_loader_long() {
    fuzz(fz::long_cases());
}

/// Found by `fuzz_checkpoint_loader_long`: a JSON escape inserted into the header made a
/// dtype `"\nF32"`, which the safetensors parser's message quoted raw (`unknown variant
/// `\nF32``), breaking the one-line error; `load_tensors` now escapes control characters.
#[test]
fn regression_line_end_in_a_quoted_header_string() {
    let bytes = valid_input();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let header = header.replacen("\"F32\"", "\"\\nF32\"", 1);
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&bytes[8 + n..]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    std::fs::write(&path, &b).unwrap();
    let msg = load_tensors(&path, &Device::Cpu).unwrap_err().to_string();
    assert!(msg.contains("bad.safetensors") && msg.contains("unknown variant `\\nF32`"), "{msg}");
    assert!(!msg.contains('\n'), "{msg:?}");
}
