//! Bad input never panics: a valid panel file (two instruments, one with gaps) damaged by
//! 1–4 random mutations (bytes flipped or overwritten, truncated, garbage appended or
//! inserted, numbers and text of the JSON header replaced) is opened, every instrument
//! taken out (mapped or gathered) and every row read. Each case ends in a valid panel or a
//! one-line error naming the file, never a panic or a hang.

use std::path::{Path, PathBuf};

use crate::bars::Bars;
use crate::fuzz_support::{self as fz, Format};
use crate::{FeatureTable, Panel, PanelFile};

fn valid_input(dir: &Path) -> Vec<u8> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/features_small.csv"));
    let bars = Bars::from_csv_path(&p).unwrap();
    let keep: Vec<usize> = (0..bars.len()).filter(|i| !(200..230).contains(i)).collect();
    let pick = |v: &[f64]| keep.iter().map(|&i| v[i]).collect::<Vec<_>>();
    let gappy = Bars {
        timestamp: keep.iter().map(|&i| bars.timestamp[i]).collect(),
        open: pick(&bars.open),
        high: pick(&bars.high),
        low: pick(&bars.low),
        close: pick(&bars.close),
        volume: pick(&bars.volume),
    };
    let panel = Panel::from_tables(vec![
        ("a".into(), FeatureTable::from_bars(&bars, "a").unwrap()),
        ("b".into(), FeatureTable::from_bars(&gappy, "b").unwrap()),
    ])
    .unwrap();
    let path = dir.join("valid.safetensors");
    panel.write(&path).unwrap();
    assert!(open(&path).unwrap().is_ok(), "the undamaged file opens");
    std::fs::read(&path).unwrap()
}

fn fuzz(cases: u32) {
    let dir = tempfile::tempdir().unwrap();
    let input = valid_input(dir.path());
    let n = std::cell::Cell::new(0u64);
    fz::run("panel-file reader", cases, fz::mutations(Format::Safetensors), |muts| {
        let bytes = fz::apply(&input, &muts, Format::Safetensors);
        // A fresh name per case: no map of an earlier case ever sees its file rewritten.
        n.set(n.get() + 1);
        let path = dir.path().join(format!("case-{}.safetensors", n.get()));
        std::fs::write(&path, &bytes).unwrap();
        let outcome = open(&path);
        let _ = std::fs::remove_file(&path);
        fz::check("panel-file reader", outcome, &bytes, Some(&path))
    });
}

/// Opens the file, takes every instrument out and reads its rows, as a run does.
fn open(path: &Path) -> Result<Result<(), String>, String> {
    let path = path.to_path_buf();
    fz::guarded(move || {
        let pf = PanelFile::open(&path).map_err(|e| e.to_string())?;
        for i in 0..pf.instruments().len() {
            let (store, rows) = pf.instrument(i).map_err(|e| e.to_string())?;
            for r in 0..store.rows() {
                std::hint::black_box((store.market_row(r), store.known_row(r), store.close()[r]));
            }
            std::hint::black_box(rows);
        }
        std::hint::black_box(pf.to_panel());
        Ok(())
    })
}

#[test]
fn fuzz_panel_file_reader() {
    fuzz(fz::DEFAULT_CASES);
}

#[test]
#[ignore = "long fuzz run (FX_FUZZ_CASES, default 10,000): cargo test --workspace -- --ignored fuzz"]
fn fuzz_panel_file_reader_long() {
    fuzz(fz::long_cases());
}
