//! Bad input never panics: a valid INT8 policy file and a valid INT8 TFT file, damaged by 1–4
//! random mutations (bytes flipped or overwritten, truncated, garbage appended or inserted,
//! numbers of the JSON header — shapes, offsets, metadata values — replaced by huge,
//! non-finite or out-of-range spellings, text inserted into the header), are loaded as
//! `eval --int8` loads them. Each case ends in a network or a one-line error naming the
//! file, never a panic or a hang.

#[path = "../../../fx-data/src/fuzz_support.rs"]
mod fz;

use fz::Format;

use super::{load, load_tft, save, save_tft, Provenance};
use crate::testing::{random_net, uniforms};
use crate::{CalibMethod, PolicyKind};

fn prov() -> Provenance {
    Provenance { source_sha256: "cd".repeat(32), source: "checkpoint-0000000040.safetensors".into() }
}

fn policy_file() -> Vec<u8> {
    let net = random_net(PolicyKind::Ppo, 56, &[16, 16], 3, 3);
    let q = crate::quantize(&net, &uniforms(3, 9, 50 * 56), CalibMethod::Percentile(99.9), &["actor.head"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.safetensors");
    save(&q, &prov(), &path).unwrap();
    load(&path, None).expect("the undamaged file loads");
    std::fs::read(&path).unwrap()
}

fn tft_file() -> Vec<u8> {
    use candle_core::{Device, Tensor};
    let cfg = fx_models::TftConfig { d: 8, n_head: 2, l_enc: 4, h: 2, n_observed: 3, n_known: 2, ..Default::default() };
    let model = fx_models::Tft::new(cfg, &Device::Cpu, 4).unwrap();
    let t = |shape: &[usize], stream: u64| {
        let n: usize = shape.iter().product();
        Tensor::from_vec(uniforms(4, stream, n), shape, &Device::Cpu).unwrap()
    };
    let q =
        crate::quantize_tft(&model, &[(t(&[2, 4, 3], 1), t(&[2, 6, 2], 2))], CalibMethod::Percentile(99.0)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.safetensors");
    save_tft(&q, &prov(), &path).unwrap();
    load_tft(&path, None).expect("the undamaged TFT file loads");
    std::fs::read(&path).unwrap()
}

fn fuzz(cases: u32) {
    for (what, input, tft) in [("INT8 policy loader", policy_file(), false), ("INT8 TFT loader", tft_file(), true)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("policy.int8.safetensors");
        fz::run(what, cases, fz::mutations(Format::Safetensors), |muts| {
            let bytes = fz::apply(&input, &muts, Format::Safetensors);
            std::fs::write(&path, &bytes).unwrap();
            let p = path.clone();
            let outcome = fz::guarded(move || {
                let r = if tft { load_tft(&p, None).map(drop) } else { load(&p, None).map(drop) };
                r.map_err(|e| e.to_string())
            });
            // Every error of these loaders names the file.
            fz::check(what, outcome, &bytes, Some(path.as_path()))
        });
    }
}

#[test]
fn fuzz_int8_loaders() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_int8_loaders_long() {
    fuzz(fz::long_cases());
}

/// Found by `fuzz_int8_loaders`: a TFT file whose `tft_config` names a huge width overflowed
/// the shape check's products (a panic in debug builds); it is refused as a shape mismatch.
#[test]
fn regression_huge_tft_width_is_refused_not_overflowed() {
    let input = tft_file();
    let n = u64::from_le_bytes(input[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&input[8..8 + n]).unwrap();
    let meta = header["__metadata__"].as_object_mut().unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(meta["tft_config"].as_str().unwrap()).unwrap();
    cfg["d"] = serde_json::json!(u64::MAX);
    meta.insert("tft_config".into(), serde_json::Value::String(cfg.to_string()));
    let header = serde_json::to_vec(&header).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&input[8 + n..]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let p = path.clone();
    let outcome = fz::guarded(move || load_tft(&p, None).map(drop).map_err(|e| e.to_string())).unwrap();
    let e = outcome.unwrap_err();
    assert!(e.contains("q.safetensors") && !e.contains('\n'), "{e}");
}
