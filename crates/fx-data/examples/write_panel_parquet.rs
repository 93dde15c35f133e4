//! Writes a synthetic daily panel as one long-format Parquet file (`timestamp` INT64 Unix
//! seconds, `symbol` UTF8, `open` / `high` / `low` / `close` / `volume` DOUBLE; date-major
//! rows, Snappy, row groups of 65,536 rows: what a pyarrow or polars dump of a universe
//! looks like), to time `fx-train features` on a panel of a real universe's size:
//!
//! ```text
//! cargo run --release -p fx-data --example write_panel_parquet -- panel.parquet 500 5040
//! fx-train features --input panel.parquet --output panel.safetensors
//! ```
//!
//! Arguments: output path, instruments, weekdays (default 500 and 5,040: twenty years), seed.
//! Every tenth instrument lists later (up to half the span), so the panel has masked cells.

use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first() else {
        return Err("usage: write_panel_parquet OUT.parquet [INSTRUMENTS=500] [WEEKDAYS=5040] [SEED=1]".into());
    };
    let arg = |i: usize, default: u64| -> Result<u64, Box<dyn std::error::Error>> {
        Ok(args.get(i).map(|s| s.parse::<u64>()).transpose()?.unwrap_or(default))
    };
    let (n_inst, n_days, seed) = (arg(1, 500)? as usize, arg(2, 5040)? as usize, arg(3, 1)?);
    let mut rng = fx_data::Rng::new(seed);
    let symbols: Vec<String> = (0..n_inst).map(|i| format!("SYM{i:04}")).collect();
    let first_day: Vec<usize> =
        (0..n_inst).map(|i| if i % 10 == 9 { (rng.uniform() * n_days as f64 / 2.0) as usize } else { 0 }).collect();
    // Weekdays from Monday 2005-01-03 00:00 UTC.
    let mut days = Vec::with_capacity(n_days);
    let mut t = 1_104_710_400i64;
    while days.len() < n_days {
        let weekday = ((t / 86_400) + 3).rem_euclid(7); // 0 = Monday
        if weekday < 5 {
            days.push(t);
        }
        t += 86_400;
    }
    let mut close: Vec<f64> = (0..n_inst).map(|_| 20.0 + 180.0 * rng.uniform()).collect();
    let vol: Vec<f64> = (0..n_inst).map(|_| 0.01 + 0.02 * rng.uniform()).collect();

    let schema = "message bars { required int64 timestamp; required binary symbol (UTF8); \
                  required double open; required double high; required double low; \
                  required double close; required double volume; }";
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema)?);
    let props = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let tmp = format!("{out}.partial");
    let mut w = SerializedFileWriter::new(std::fs::File::create(&tmp)?, schema, props)?;
    const GROUP: usize = 65_536;
    let (mut ts, mut sym, mut cols) = (Vec::new(), Vec::new(), [(); 5].map(|_| Vec::<f64>::new()));
    let mut rows = 0usize;
    let mut flush =
        |ts: &mut Vec<i64>, sym: &mut Vec<ByteArray>, cols: &mut [Vec<f64>; 5]| -> parquet::errors::Result<()> {
            if ts.is_empty() {
                return Ok(());
            }
            let mut rg = w.next_row_group()?;
            let mut c = rg.next_column()?.expect("timestamp");
            c.typed::<Int64Type>().write_batch(ts, None, None)?;
            c.close()?;
            let mut c = rg.next_column()?.expect("symbol");
            c.typed::<ByteArrayType>().write_batch(sym, None, None)?;
            c.close()?;
            for v in cols.iter() {
                let mut c = rg.next_column()?.expect("a price column");
                c.typed::<DoubleType>().write_batch(v, None, None)?;
                c.close()?;
            }
            rg.close()?;
            ts.clear();
            sym.clear();
            cols.iter_mut().for_each(Vec::clear);
            Ok(())
        };
    for (d, &day) in days.iter().enumerate() {
        for i in 0..n_inst {
            if d < first_day[i] {
                continue;
            }
            let open = close[i];
            let c = open * (vol[i] * rng.normal()).exp();
            let (hi, lo) = (
                open.max(c) * (1.0 + 0.5 * vol[i] * rng.uniform()),
                open.min(c) * (1.0 - 0.5 * vol[i] * rng.uniform()),
            );
            close[i] = c;
            ts.push(day);
            sym.push(ByteArray::from(symbols[i].as_str()));
            for (col, v) in cols.iter_mut().zip([open, hi, lo, c, (1e5 + 1e6 * rng.uniform()).round()]) {
                col.push(v);
            }
            rows += 1;
            if ts.len() == GROUP {
                flush(&mut ts, &mut sym, &mut cols)?;
            }
        }
    }
    flush(&mut ts, &mut sym, &mut cols)?;
    w.close()?;
    std::fs::rename(&tmp, out)?;
    let bytes = std::fs::metadata(out)?.len();
    println!("wrote {out}: {n_inst} instruments x {n_days} weekdays, {rows} rows, {bytes} bytes");
    Ok(())
}
