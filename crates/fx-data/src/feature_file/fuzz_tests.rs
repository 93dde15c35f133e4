//! Bad input never panics: valid feature files damaged by 1–4 random mutations (bytes
//! flipped or overwritten, truncated, garbage appended or inserted, numbers of the JSON
//! header — shapes, offsets, `rows`, metadata — replaced by huge, non-finite or
//! out-of-range spellings, text inserted into the header) are opened and every row read.
//! Each case ends in a valid store or a one-line error naming the file, never a panic or
//! a hang.

use std::path::{Path, PathBuf};

use crate::feature_file::FeatureStore;
use crate::fuzz_support::{self as fz, Format};

fn valid_input() -> Vec<u8> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/features_small.safetensors"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn fuzz(cases: u32) {
    let input = valid_input();
    FeatureStore::open(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/fixtures/features_small.safetensors"
    )))
    .expect("the undamaged file opens");
    let dir = tempfile::tempdir().unwrap();
    let n = std::cell::Cell::new(0u64);
    fz::run("feature-file reader", cases, fz::mutations(Format::Safetensors), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Safetensors);
        // A fresh name per case: no map of an earlier case ever sees its file rewritten.
        n.set(n.get() + 1);
        let path = dir.path().join(format!("case-{}.safetensors", n.get()));
        std::fs::write(&path, &bytes).unwrap();
        let outcome = open(&path);
        let _ = std::fs::remove_file(&path);
        fz::check("feature-file reader", outcome, &bytes, Some(&path))
    });
}

/// Opens the file and reads every column and row, as training does.
fn open(path: &Path) -> Result<Result<(), String>, String> {
    let path = path.to_path_buf();
    fz::guarded(move || {
        let store = FeatureStore::open(&path).map_err(|e| e.to_string())?;
        let t = store.to_table();
        for i in 0..store.rows() {
            std::hint::black_box((store.market_row(i), store.known_row(i)));
        }
        std::hint::black_box((t, store.feature_names(), store.source()));
        Ok(())
    })
}

#[test]
fn fuzz_feature_file_reader() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_feature_file_reader_long() {
    fuzz(fz::long_cases());
}

/// `valid_input()` with `from` replaced by `to` in its JSON header, opened.
fn open_with_header_edit(from: &str, to: &str) -> String {
    let bytes = valid_input();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    assert!(header.contains(from), "{from}");
    let header = header.replacen(from, to, 1);
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.extend_from_slice(&bytes[8 + n..]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    std::fs::write(&path, &b).unwrap();
    open(&path).unwrap().unwrap_err()
}

/// Found by `fuzz_feature_file_reader_long`: a JSON escape inserted into the header put a
/// line end into a string the error quoted raw — the schema tag (`fx-featu\res/1`) or,
/// through the safetensors parser's message, a dtype (`unknown variant `\nF32``) —
/// breaking the one-line message. Format errors now escape control characters.
#[test]
fn regression_line_end_in_a_quoted_header_string() {
    let msg = open_with_header_edit("fx-features/1", "fx-featu\\res/1");
    assert!(msg.contains("bad.safetensors: schema is `fx-featu\\res/1`, expected `fx-features/1`"), "{msg}");
    assert!(!msg.contains('\r'), "{msg:?}");
    let msg = open_with_header_edit("\"F32\"", "\"\\nF32\"");
    assert!(msg.contains("bad.safetensors: not a valid safetensors file") && msg.contains("`\\nF32`"), "{msg}");
    assert!(!msg.contains('\n'), "{msg:?}");
}
