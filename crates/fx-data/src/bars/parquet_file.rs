//! Parquet bars (DATA.md "Input bars", Parquet): the columns of a bar CSV (`timestamp` or
//! `date` / `time` / `datetime`, `open`, `high`, `low`, `close`, `volume`, any order, any
//! other columns ignored) and, for a panel in long format, a `symbol` / `ticker` /
//! `instrument` column, as pandas, pyarrow, polars or NautilusTrader write them.
//!
//! Read through the `parquet` crate's record API (no Arrow: a bar file is a few columns, and
//! Arrow would add a dozen crates to every build). The same row rules as a CSV hold, checked
//! row by row; an error names the file, the row (1-based over the file's rows, across row
//! groups) and, in a long file, the instrument.
//!
//! Timestamps: an integer column without a logical type is Unix seconds (as in a CSV);
//! `TIMESTAMP` columns are converted from their unit (milli-, micro- or nanoseconds; a naive
//! one is UTC, as a naive ISO time in a CSV), floored to the second; `DATE` is midnight UTC;
//! a string column is parsed as a CSV cell is. Prices and volume may be any float or integer
//! column; a null anywhere in a used column is an error, never a skipped row.

use std::collections::BTreeMap;
use std::path::Path;

use ::parquet::basic::{LogicalType, TimeUnit};
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::Field;

use super::{check_row, parse_timestamp, Bars, RowValues, COLUMNS, SYMBOL_ALIASES, TIMESTAMP_ALIASES};
use crate::error::{one_line, Error};
use crate::features::WARMUP;

/// Each instrument's bars in row order with each bar's row (1-based), instruments sorted by
/// name. Without a symbol column the file is one instrument, named by the file's stem. Each
/// instrument needs more than [`WARMUP`] bars.
pub fn read_parquet(path: &Path) -> Result<Vec<(String, Bars, Vec<u64>)>, Error> {
    // The decoder is third-party code over untrusted bytes: a malformed file it panics on is
    // reported as this file's error, not an abort.
    match std::panic::catch_unwind(|| read(path)) {
        Ok(r) => r,
        Err(_) => Err(Error::format(path, "the Parquet decoder failed on this file (damaged or not Parquet?)")),
    }
}

/// Whether `path` names a Parquet file by its extension (`.parquet`, `.pq`).
pub fn is_parquet(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet") || e.eq_ignore_ascii_case("pq"))
}

/// How the timestamp column's integers read as seconds.
#[derive(Clone, Copy)]
enum TsUnit {
    Seconds,
    /// Per second: 1e3, 1e6 or 1e9.
    Fraction(i64),
    Days,
}

fn read(path: &Path) -> Result<Vec<(String, Bars, Vec<u64>)>, Error> {
    let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| Error::format(path, format!("not a readable Parquet file: {}", one_line(&e.to_string()))))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let mut idx: [Option<usize>; 6] = [None; 6];
    let mut symbol = None;
    let mut ts_unit = TsUnit::Seconds;
    let names: Vec<String> = schema.root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
    for (i, raw) in names.iter().enumerate() {
        let name = raw.trim().to_ascii_lowercase();
        if SYMBOL_ALIASES.contains(&name.as_str()) {
            if symbol.is_some() {
                return Err(Error::format(path, "more than one symbol column (symbol, ticker, instrument)"));
            }
            symbol = Some(i);
            continue;
        }
        let col =
            if TIMESTAMP_ALIASES.contains(&name.as_str()) { Some(0) } else { COLUMNS.iter().position(|c| *c == name) };
        let Some(col) = col else { continue };
        if idx[col].is_some() {
            return Err(Error::format(path, format!("column `{}` appears more than once", COLUMNS[col])));
        }
        idx[col] = Some(i);
        if col == 0 {
            // Leaf i of a flat schema is column i; a nested column is refused below by its value.
            if let Some(c) = schema.columns().iter().find(|c| c.path().parts() == [raw.as_str()]) {
                ts_unit = match c.logical_type_ref() {
                    Some(LogicalType::Timestamp(t)) => TsUnit::Fraction(match t.unit {
                        TimeUnit::MILLIS => 1_000,
                        TimeUnit::MICROS => 1_000_000,
                        TimeUnit::NANOS => 1_000_000_000,
                    }),
                    Some(LogicalType::Date) => TsUnit::Days,
                    _ => TsUnit::Seconds,
                };
            }
        }
    }
    let mut cols = [0usize; 6];
    for (k, slot) in idx.iter().enumerate() {
        cols[k] = slot.ok_or_else(|| {
            let what = if k == 0 { "timestamp (or date, time, datetime)" } else { COLUMNS[k] };
            Error::format(path, format!("missing required column `{what}` (columns: {})", one_line(&names.join(", "))))
        })?;
    }
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| Error::format(path, format!("reading rows: {}", one_line(&e.to_string()))))?;
    let single = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut by: BTreeMap<String, (Bars, Vec<u64>)> = BTreeMap::new();
    for (r, row) in rows.enumerate() {
        let n = r as u64 + 1;
        let err = |rule: String| Error::Row { path: path.to_path_buf(), row: n, rule };
        let row = row.map_err(|e| err(format!("unreadable: {}", one_line(&e.to_string()))))?;
        let fields: Vec<&Field> = row.get_column_iter().map(|(_, f)| f).collect();
        let name = match symbol {
            None => single.clone(),
            Some(c) => match fields.get(c) {
                Some(Field::Str(s)) if !s.trim().is_empty() => s.trim().to_string(),
                Some(Field::Bytes(b)) if b.as_utf8().is_ok_and(|s| !s.trim().is_empty()) => {
                    b.as_utf8().unwrap_or_default().trim().to_string()
                }
                Some(Field::Null) | None => return Err(err("the symbol is null".into())),
                Some(Field::Str(_)) | Some(Field::Bytes(_)) => return Err(err("the symbol is empty".into())),
                Some(other) => return Err(err(format!("the symbol is not text ({})", one_line(&other.to_string())))),
            },
        };
        let in_name = |rule: String| if symbol.is_some() { format!("{}: {rule}", one_line(&name)) } else { rule };
        let field = |k: usize| fields.get(cols[k]).copied().unwrap_or(&Field::Null);
        let ts = timestamp(field(0), ts_unit).map_err(|rule| err(in_name(rule)))?;
        let mut vals = [0.0f64; 5];
        for k in 1..6 {
            vals[k - 1] = number(field(k)).ok_or_else(|| {
                err(in_name(format!("`{}` is not a number ({})", COLUMNS[k], one_line(&field(k).to_string()))))
            })?;
        }
        let v = RowValues { ts, open: vals[0], high: vals[1], low: vals[2], close: vals[3], volume: vals[4] };
        let (bars, at) = by.entry(name.clone()).or_default();
        check_row(&v, bars.timestamp.last().copied(), None).map_err(|rule| err(in_name(rule)))?;
        bars.push(&v);
        at.push(n);
    }
    if by.is_empty() {
        return Err(Error::format(path, "holds no rows"));
    }
    if symbol.is_none() {
        // One instrument: the same error as its CSV's.
        let bars = by.values().next().map_or(0, |(b, _)| b.len());
        if bars <= WARMUP {
            return Err(Error::TooFewBars { path: path.to_path_buf(), bars, warmup: WARMUP });
        }
    }
    super::past_warmup(path, by)
}

/// A timestamp cell as Unix seconds.
fn timestamp(f: &Field, unit: TsUnit) -> Result<i64, String> {
    let int = |v: i64| match unit {
        TsUnit::Seconds => Some(v),
        TsUnit::Fraction(per) => Some(v.div_euclid(per)),
        TsUnit::Days => v.checked_mul(86_400),
    };
    let secs = match f {
        Field::Long(v) => int(*v),
        Field::Int(v) => int(*v as i64),
        Field::ULong(v) => i64::try_from(*v).ok().and_then(int),
        Field::UInt(v) => int(*v as i64),
        Field::Date(d) => Some(*d as i64 * 86_400),
        Field::TimestampMillis(v) => Some(v.div_euclid(1_000)),
        Field::TimestampMicros(v) => Some(v.div_euclid(1_000_000)),
        Field::Str(s) => parse_timestamp(s),
        Field::Null => return Err("timestamp is null".into()),
        other => return Err(format!("timestamp is neither a time nor an integer ({})", one_line(&other.to_string()))),
    };
    secs.ok_or_else(|| format!("timestamp is out of range or not ISO-8601 ({})", one_line(&f.to_string())))
}

/// A price or volume cell as f64 (`None`: null or not numeric).
fn number(f: &Field) -> Option<f64> {
    Some(match f {
        Field::Double(v) => *v,
        Field::Float(v) => *v as f64,
        Field::Float16(v) => f64::from(*v),
        Field::Long(v) => *v as f64,
        Field::Int(v) => *v as f64,
        Field::Short(v) => *v as f64,
        Field::Byte(v) => *v as f64,
        Field::ULong(v) => *v as f64,
        Field::UInt(v) => *v as f64,
        Field::UShort(v) => *v as f64,
        Field::UByte(v) => *v as f64,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::parquet::data_type::{ByteArray, ByteArrayType, DoubleType, Int32Type, Int64Type};
    use ::parquet::file::properties::WriterProperties;
    use ::parquet::file::writer::SerializedFileWriter;
    use std::path::PathBuf;
    use std::sync::Arc;

    /// One column's cells (`None`: null; every column is written OPTIONAL).
    enum Col {
        I64(Vec<Option<i64>>),
        I32(Vec<Option<i32>>),
        F64(Vec<Option<f64>>),
        Str(Vec<Option<String>>),
    }

    /// Writes `cols` under the message type `schema` (fields in the same order) to `path`.
    fn write(path: &Path, schema: &str, cols: &[Col], codec: ::parquet::basic::Compression) {
        let schema = Arc::new(::parquet::schema::parser::parse_message_type(schema).unwrap());
        let props =
            Arc::new(WriterProperties::builder().set_compression(codec).set_max_row_group_row_count(Some(97)).build());
        let mut w = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
        let n = match &cols[0] {
            Col::I64(v) => v.len(),
            Col::I32(v) => v.len(),
            Col::F64(v) => v.len(),
            Col::Str(v) => v.len(),
        };
        // Row groups of 97 rows: an error's row must count across groups.
        for start in (0..n).step_by(97) {
            let end = (start + 97).min(n);
            let mut rg = w.next_row_group().unwrap();
            for c in cols {
                let mut cw = rg.next_column().unwrap().unwrap();
                fn split<T: Clone>(v: &[Option<T>]) -> (Vec<T>, Vec<i16>) {
                    (v.iter().flatten().cloned().collect(), v.iter().map(|x| i16::from(x.is_some())).collect())
                }
                match c {
                    Col::I64(v) => {
                        let (vals, def) = split(&v[start..end]);
                        cw.typed::<Int64Type>().write_batch(&vals, Some(&def), None).unwrap();
                    }
                    Col::I32(v) => {
                        let (vals, def) = split(&v[start..end]);
                        cw.typed::<Int32Type>().write_batch(&vals, Some(&def), None).unwrap();
                    }
                    Col::F64(v) => {
                        let (vals, def) = split(&v[start..end]);
                        cw.typed::<DoubleType>().write_batch(&vals, Some(&def), None).unwrap();
                    }
                    Col::Str(v) => {
                        let (vals, def) = split(&v[start..end]);
                        let vals: Vec<ByteArray> = vals.iter().map(|s| ByteArray::from(s.as_str())).collect();
                        cw.typed::<ByteArrayType>().write_batch(&vals, Some(&def), None).unwrap();
                    }
                }
                cw.close().unwrap();
            }
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    fn some<T: Clone>(v: &[T]) -> Vec<Option<T>> {
        v.iter().cloned().map(Some).collect()
    }

    /// Fresh random bars that pass the row rules (`n` bars, daily, from a seed of the clock).
    fn random_bars(n: usize, seed: u64) -> Bars {
        let mut rng = crate::Rng::new(seed);
        let mut b = Bars::default();
        let mut px = 50.0 + 100.0 * rng.uniform();
        let mut ts = 946_684_800 + (rng.next_u64() % 1000) as i64 * 86_400;
        for _ in 0..n {
            let open = px;
            px *= (0.02 * (rng.uniform() - 0.5)).exp();
            let (hi, lo) = (open.max(px) * (1.0 + 0.01 * rng.uniform()), open.min(px) * (1.0 - 0.01 * rng.uniform()));
            b.push(&RowValues { ts, open, high: hi, low: lo, close: px, volume: (rng.next_u64() % 1_000_000) as f64 });
            ts += 86_400 * (1 + (rng.next_u64() % 3) as i64);
        }
        b
    }

    fn clock_seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    const OHLCV: &str = "optional double open; optional double high; optional double low; optional double close; optional double volume;";

    fn ohlcv(b: &Bars) -> Vec<Col> {
        vec![
            Col::F64(some(&b.open)),
            Col::F64(some(&b.high)),
            Col::F64(some(&b.low)),
            Col::F64(some(&b.close)),
            Col::F64(some(&b.volume)),
        ]
    }

    /// One instrument's bars, integer-second timestamps, snappy.
    fn write_one(path: &Path, b: &Bars) {
        let mut cols = vec![Col::I64(some(&b.timestamp))];
        cols.extend(ohlcv(b));
        write(
            path,
            &format!("message bars {{ optional int64 timestamp; {OHLCV} }}"),
            &cols,
            ::parquet::basic::Compression::SNAPPY,
        );
    }

    #[test]
    fn one_instrument_reads_back_exactly_in_every_timestamp_encoding_and_codec() {
        let dir = tempfile::tempdir().unwrap();
        let seed = clock_seed();
        let b = random_bars(300, seed);
        let secs = b.timestamp.clone();
        let cases: Vec<(&str, &str, Col)> = vec![
            ("seconds", "optional int64 timestamp;", Col::I64(some(&secs))),
            (
                "nanos",
                "optional int64 date (TIMESTAMP(NANOS,false));",
                Col::I64(secs.iter().map(|s| Some(s * 1_000_000_000 + 999_999_999)).collect()),
            ),
            (
                "micros",
                "optional int64 Time (TIMESTAMP(MICROS,true));",
                Col::I64(secs.iter().map(|s| Some(s * 1_000_000 + 5)).collect()),
            ),
            (
                "millis",
                "optional int64 datetime (TIMESTAMP(MILLIS,true));",
                Col::I64(secs.iter().map(|s| Some(s * 1_000)).collect()),
            ),
            (
                "date32",
                "optional int32 date (DATE);",
                Col::I32(secs.iter().map(|s| Some((s / 86_400) as i32)).collect()),
            ),
            (
                "iso",
                "optional binary timestamp (STRING);",
                Col::Str(
                    secs.iter()
                        .map(|&s| {
                            Some(
                                chrono::DateTime::from_timestamp(s, 0)
                                    .unwrap()
                                    .format("%Y-%m-%dT%H:%M:%SZ")
                                    .to_string(),
                            )
                        })
                        .collect(),
                ),
            ),
        ];
        use ::parquet::basic::Compression as C;
        // Every codec the build reads, one per case.
        let codecs =
            [C::SNAPPY, C::ZSTD(Default::default()), C::LZ4_RAW, C::GZIP(Default::default()), C::UNCOMPRESSED, C::LZ4];
        for ((name, ts_field, ts_col), codec) in cases.into_iter().zip(codecs) {
            let path = dir.path().join(format!("{name}.parquet"));
            let mut cols = vec![ts_col];
            cols.extend(ohlcv(&b));
            write(&path, &format!("message bars {{ {ts_field} {OHLCV} }}"), &cols, codec);
            let got = read_parquet(&path).unwrap();
            assert_eq!(got.len(), 1, "{name}");
            assert_eq!(got[0].0, name, "named by the file stem");
            assert_eq!(got[0].1, b, "{name} (seed {seed})");
            assert_eq!(got[0].2, (1..=300).collect::<Vec<u64>>());
        }
    }

    #[test]
    fn a_long_file_splits_into_instruments_and_matches_the_long_csv() {
        let dir = tempfile::tempdir().unwrap();
        let seed = clock_seed();
        let (a, z) = (random_bars(250, seed), random_bars(180, seed ^ 0x5eed));
        // Interleaved by time, as a database export is; the CSV twin holds the same rows.
        let mut rows: Vec<(i64, &str, usize)> = (0..a.len()).map(|i| (a.timestamp[i], "AAA", i)).collect();
        rows.extend((0..z.len()).map(|i| (z.timestamp[i], "ZZZ", i)));
        rows.sort();
        let pick = |f: fn(&Bars) -> &Vec<f64>| -> Col {
            Col::F64(rows.iter().map(|&(_, s, i)| Some(f(if s == "AAA" { &a } else { &z })[i])).collect())
        };
        let cols = vec![
            Col::Str(rows.iter().map(|r| Some(r.1.to_string())).collect()),
            Col::I64(rows.iter().map(|r| Some(r.0)).collect()),
            pick(|b| &b.open),
            pick(|b| &b.high),
            pick(|b| &b.low),
            pick(|b| &b.close),
            pick(|b| &b.volume),
        ];
        let pq = dir.path().join("long.parquet");
        write(
            &pq,
            &format!("message bars {{ optional binary Ticker (STRING); optional int64 timestamp; {OHLCV} }}"),
            &cols,
            ::parquet::basic::Compression::ZSTD(Default::default()),
        );
        let csv = dir.path().join("long.csv");
        let mut text = String::from("ticker,timestamp,open,high,low,close,volume\n");
        for &(ts, s, i) in &rows {
            let b = if s == "AAA" { &a } else { &z };
            text += &format!(
                "{s},{ts},{:?},{:?},{:?},{:?},{:?}\n",
                b.open[i], b.high[i], b.low[i], b.close[i], b.volume[i]
            );
        }
        std::fs::write(&csv, text).unwrap();
        let got = read_parquet(&pq).unwrap();
        let want = crate::bars::read_long_csv(&csv).unwrap();
        assert_eq!(got.len(), 2);
        for ((gn, gb, _), (wn, wb, _)) in got.iter().zip(&want) {
            assert_eq!((gn, gb), (wn, wb), "seed {seed}");
        }
        assert_eq!((&got[0].1, &got[1].1), (&a, &z));
        // Rows (1-based, across row groups of 97) of each instrument's bars.
        let aaa_rows: Vec<u64> =
            rows.iter().enumerate().filter(|(_, r)| r.1 == "AAA").map(|(k, _)| k as u64 + 1).collect();
        assert_eq!(got[0].2, aaa_rows);
        let p = crate::Panel::from_parquet(&pq).unwrap();
        assert_eq!(p, crate::Panel::from_long_csv(&csv).unwrap());
        assert_eq!(crate::Panel::load(&pq).unwrap(), Some(p));
    }

    /// Each broken rule stops at its row (counted across row groups), naming the instrument
    /// of a long file; a null is an error, never a skipped row.
    #[test]
    fn bad_rows_name_the_file_row_and_rule() {
        let dir = tempfile::tempdir().unwrap();
        let b = random_bars(200, 11);
        let base = |f: &dyn Fn(&mut Vec<Col>)| {
            let mut cols = vec![Col::Str(vec![Some("X".into()); 200]), Col::I64(some(&b.timestamp))];
            cols.extend(ohlcv(&b));
            f(&mut cols);
            cols
        };
        let schema = format!("message bars {{ optional binary symbol (STRING); optional int64 timestamp; {OHLCV} }}");
        type Damage = Box<dyn Fn(&mut Vec<Col>)>;
        let cases: Vec<(&str, Damage, &str)> = vec![
            (
                "null close",
                Box::new(|c| {
                    if let Col::F64(v) = &mut c[5] {
                        v[150] = None
                    }
                }),
                "row 151: X: `close` is not a number (null)",
            ),
            (
                "null symbol",
                Box::new(|c| {
                    if let Col::Str(v) = &mut c[0] {
                        v[98] = None
                    }
                }),
                "row 99: the symbol is null",
            ),
            (
                "late bar",
                Box::new(|c| {
                    if let Col::I64(v) = &mut c[1] {
                        v[120] = v[119]
                    }
                }),
                "row 121: X: timestamps must be strictly increasing",
            ),
            (
                "low",
                Box::new(|c| {
                    if let Col::F64(v) = &mut c[4] {
                        v[7] = Some(1e9)
                    }
                }),
                "row 8: X: low must be <= min(open, close)",
            ),
            (
                "null ts",
                Box::new(|c| {
                    if let Col::I64(v) = &mut c[1] {
                        v[0] = None
                    }
                }),
                "row 1: X: timestamp is null",
            ),
        ];
        for (name, f, want) in cases {
            let path = dir.path().join(format!("{}.parquet", name.replace(' ', "_")));
            write(&path, &schema, &base(&*f), ::parquet::basic::Compression::UNCOMPRESSED);
            let e = read_parquet(&path).unwrap_err().to_string();
            assert!(e.starts_with(&path.display().to_string()) && e.ends_with(want), "{name}: {e}");
            assert!(!e.contains('\n'), "{name}: one line: {e}");
        }
        // A missing column names what the file has.
        let path = dir.path().join("no_volume.parquet");
        let cols = base(&|c| {
            c.pop();
        });
        write(&path, "message bars { optional binary symbol (STRING); optional int64 timestamp; optional double open; optional double high; optional double low; optional double close; }", &cols, ::parquet::basic::Compression::SNAPPY);
        let e = read_parquet(&path).unwrap_err().to_string();
        assert!(e.contains("missing required column `volume`") && e.contains("symbol, timestamp, open"), "{e}");
        // Too few bars for the warm-up.
        let path = dir.path().join("short.parquet");
        let s = random_bars(WARMUP, 3);
        write_one(&path, &s);
        assert!(matches!(read_parquet(&path), Err(Error::TooFewBars { bars, .. }) if bars == WARMUP));
    }

    /// Not Parquet, or a Parquet file cut short or with flipped bytes: a one-line error
    /// naming the file, never a panic.
    #[test]
    fn damaged_files_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let b = random_bars(300, 5);
        let good = dir.path().join("good.parquet");
        write_one(&good, &b);
        let bytes = std::fs::read(&good).unwrap();
        let csv = dir.path().join("bars.parquet");
        std::fs::write(&csv, "timestamp,open,high,low,close,volume\n").unwrap();
        let mut damaged: Vec<(String, Vec<u8>)> =
            vec![("csv".into(), std::fs::read(&csv).unwrap()), ("empty".into(), Vec::new())];
        for cut in [8, bytes.len() / 2, bytes.len() - 9] {
            damaged.push((format!("cut{cut}"), bytes[..cut].to_vec()));
        }
        let mut rng = crate::Rng::new(clock_seed());
        for k in 0..24 {
            let mut v = bytes.clone();
            for _ in 0..4 {
                let i = (rng.next_u64() % v.len() as u64) as usize;
                v[i] ^= 1 << (rng.next_u64() % 8);
            }
            damaged.push((format!("flip{k}"), v));
        }
        for (name, v) in damaged {
            let path: PathBuf = dir.path().join(format!("{name}.parquet"));
            std::fs::write(&path, &v).unwrap();
            // A flipped byte inside a value may still decode into valid bars: only the
            // outcome's shape is checked.
            if let Err(e) = read_parquet(&path) {
                let e = e.to_string();
                assert!(e.starts_with(&path.display().to_string()) && !e.contains('\n'), "{name}: {e}");
            }
        }
    }

    /// pandas / pyarrow's own files (`tests/data/make_parquet.py`): a zstd long file with
    /// `timestamp[ns]` dates and the pandas index column, and a snappy `date32` file, read
    /// as the CSVs they were made from.
    #[test]
    fn pandas_files_read_as_their_csvs() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let shared = here.join("../../../shared/data");
        let long = crate::Panel::from_parquet(&here.join("tests/data/stocks_long.parquet")).unwrap();
        let dir = crate::Panel::from_csv_dir(&shared).unwrap();
        assert_eq!(long.instruments, ["aapl_daily_2000_2013", "ibm_daily_2000_2013", "msft_daily_2000_2013"]);
        assert_eq!(long, dir);
        let one = crate::FeatureTable::from_parquet(&here.join("tests/data/msft_date32.parquet")).unwrap();
        let csv = crate::FeatureTable::from_csv(&shared.join("msft_daily_2000_2013.csv")).unwrap();
        assert_eq!((&one.market, &one.timestamp, &one.close), (&csv.market, &csv.timestamp, &csv.close));
        let e =
            crate::FeatureTable::from_parquet(&here.join("tests/data/stocks_long.parquet")).unwrap_err().to_string();
        assert!(e.contains("holds 3 instruments") && e.contains("is a panel"), "{e}");
    }
}
