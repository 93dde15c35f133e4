//! Bad input never panics: valid bar CSVs damaged by 1–4 random mutations (bytes flipped,
//! truncated, lines duplicated, swapped or dropped, numbers replaced by huge, non-finite or
//! out-of-range spellings, text inserted) go through the whole `fx-train features` path
//! (read, compute the features, write the file), and a long-format file of two instruments
//! goes through `Panel::from_long_csv`. Each case ends in a valid result or a one-line error
//! naming the input file, never a panic or a hang.

use std::path::{Path, PathBuf};

use crate::feature_file::build_feature_file;
use crate::fuzz_support::{self as fz, Format};

fn valid_inputs() -> Vec<Vec<u8>> {
    let shared = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared"));
    ["fixtures/features_small.csv", "fixtures/features_small_iso.csv", "data/aapl_daily_2000_2013.csv"]
        .iter()
        .map(|f| std::fs::read(shared.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")))
        .collect()
}

fn fuzz(cases: u32) {
    let inputs = valid_inputs();
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("bars.csv"), dir.path().join("features.safetensors"));
    let strategy = (0..inputs.len(), fz::mutations(Format::Text));
    fz::run("CSV reader", cases, strategy, |(k, muts)| {
        let bytes = fz::apply(&inputs[k], &muts, Format::Text);
        std::fs::write(&input, &bytes).unwrap();
        let _ = std::fs::remove_file(&output);
        let outcome = read(&input, &output);
        fz::check("CSV reader", outcome, &bytes, Some(&input))
    });
}

fn read(input: &Path, output: &Path) -> Result<Result<(), String>, String> {
    let (input, output) = (input.to_path_buf(), output.to_path_buf());
    fz::guarded(move || build_feature_file(&input, &output).map(drop).map_err(|e| e.to_string()))
}

/// A long-format file of two instruments (rows interleaved) as `features --input` reads it:
/// each damaged case ends in a panel or a one-line error naming the file.
fn fuzz_long(cases: u32) {
    let shared = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared"));
    let text = std::fs::read_to_string(shared.join("fixtures/features_small.csv")).unwrap();
    let mut long = String::from("timestamp,ticker,open,high,low,close,volume\n");
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let (ts, rest) = line.split_once(',').unwrap();
        long.push_str(&format!("{ts},AAA,{rest}\n{ts},BBB,{rest}\n"));
    }
    let input = long.into_bytes();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("universe.csv");
    fz::run("long-format CSV reader", cases, fz::mutations(Format::Text), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Text);
        std::fs::write(&path, &bytes).unwrap();
        let p = path.clone();
        let outcome = fz::guarded(move || crate::Panel::from_long_csv(&p).map(drop).map_err(|e| e.to_string()));
        fz::check("long-format CSV reader", outcome, &bytes, Some(&path))
    });
}

#[test]
fn fuzz_long_format_reader() {
    fuzz_long(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_long_format_reader_long() {
    fuzz_long(fz::long_cases());
}

#[test]
fn fuzz_csv_reader() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_csv_reader_long() {
    fuzz(fz::long_cases());
}

/// A bars file: the header, `rows` (bad or not), then enough good hourly rows after
/// them; the first bad row is at line 2.
fn bars_with(rows: &[&str]) -> String {
    let mut s = String::from("timestamp,open,high,low,close,volume\n");
    for r in rows {
        s += r;
        s.push('\n');
    }
    for i in 0..200 {
        s += &format!("{},2,3,1,2,5\n", 1_800_000_000 + 3600 * i);
    }
    s
}

fn read_text(text: &str) -> Result<Result<(), String>, String> {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("bars.csv"), dir.path().join("f.safetensors"));
    std::fs::write(&input, text).unwrap();
    read(&input, &output)
}

/// Found by `fuzz_csv_reader`: a multi-byte character inside an ISO timestamp put a
/// string slice boundary inside it and panicked (`2024-01-€09 04:00:00`).
#[test]
fn regression_multibyte_character_in_an_iso_timestamp() {
    for ts in [
        "2024-01-€09 04:00:00",
        "2024-01-0é",
        "2024-01-01T01:0é",
        "2024-01-01T01:00:é",
        "2024-01-01T01:00+0é0",
        "2024-01-01T01:00:00.5+0€",
    ] {
        let msg = read_text(&bars_with(&[&format!("{ts},2,3,1,2,5")])).unwrap().unwrap_err();
        assert!(msg.contains("bars.csv:2: timestamp is neither unix seconds nor ISO-8601"), "{ts}: {msg}");
    }
}

/// Found by `fuzz_csv_reader`: a stray carriage return inside a cell was quoted raw,
/// breaking the one-line error (`1\r704070800`); control characters are now escaped.
#[test]
fn regression_control_character_in_a_quoted_cell() {
    for (row, want) in [
        ("1\r704070800,2,3,1,2,5", "(`1\\r704070800`)"),
        ("1704070800,2,3\r5,1,2,5", "`high` is not a number (`3\\r5`)"),
        ("1704070800,2,3,1,-2\0,5", "`close` is not a number (`-2\\u{0}`)"),
    ] {
        let msg = read_text(&bars_with(&[row])).unwrap().unwrap_err();
        assert!(!msg.contains('\r') && !msg.contains('\0') && msg.contains(want), "{row:?}: {msg}");
    }
}
