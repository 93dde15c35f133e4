//! The safetensors feature file of DATA.md ("Feature file", schema
//! `fx-features/1`): [`FeatureTable`] is the owned, in-memory form;
//! [`FeatureStore`] is what training reads, either memory-mapped from a file
//! (zero-copy `&[f32]` rows) or wrapping a table, so every consumer sees one
//! type whichever way the rows came.
//!
//! Alignment: the safetensors writer (Rust and Python alike) pads the header
//! to 8 bytes and the mmap base is page-aligned, so tensors are normally
//! aligned and borrowed in place. A file from another writer whose tensor data
//! is not aligned for its dtype is still accepted: that tensor alone is copied
//! once into an owned buffer at open ([`FeatureStore::copied_bytes`] says how
//! much was copied).

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytemuck::Pod;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, View};

use crate::bars::Bars;
use crate::error::Error;
use crate::features::{self, N_KNOWN};

/// The schema tag stored in the file's metadata.
pub const SCHEMA: &str = "fx-features/1";

/// An owned feature table: what the feature extraction produces and what a
/// feature file holds. Row-major; `rows = close.len()`.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureTable {
    /// Raw market features, `[rows, feature_names.len()]` row-major.
    pub market: Vec<f32>,
    /// Calendar features, `[rows, 4]` row-major.
    pub known: Vec<f32>,
    /// `ln(c_{t+1}/c_t)`, 0 for the last row.
    pub logret_next: Vec<f32>,
    /// Close price of each row's bar.
    pub close: Vec<f64>,
    /// Unix seconds of each row's bar, strictly increasing.
    pub timestamp: Vec<i64>,
    /// Market feature names, in column order.
    pub feature_names: Vec<String>,
    /// Where the rows came from (input file name, or e.g. `synthetic(seed=1)`).
    pub source: String,
}

impl FeatureTable {
    /// Computes the feature table of `bars` (see [`features::compute`]).
    pub fn from_bars(bars: &Bars, source: &str) -> Result<Self, Error> {
        features::compute(bars, source)
    }

    /// Reads `path`'s bars and computes their features. A feature that comes out NaN or
    /// infinite (a price valid by the row rules but extreme enough to overflow a feature)
    /// is reported at the CSV line of the first bar whose row holds it, `file:line: rule`.
    pub fn from_csv(path: &Path) -> Result<Self, Error> {
        let (bars, lines) = Bars::from_csv_path_with_lines(path)?;
        let source = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Self::from_bars_at_lines(&bars, &lines, path, &source)
    }

    /// Reads a Parquet bar file of one instrument (see [`crate::bars::read_parquet`]) and
    /// computes its features; a non-finite feature is reported at its bar's row. A file whose
    /// symbol column names several instruments is a panel ([`crate::Panel::from_parquet`]).
    pub fn from_parquet(path: &Path) -> Result<Self, Error> {
        let mut all = crate::bars::read_parquet(path)?;
        if all.len() > 1 {
            return Err(Error::format(
                path,
                format!(
                    "holds {} instruments ({}, ...): a long-format file is a panel, not one instrument's bars",
                    all.len(),
                    crate::error::one_line(&all[0].0)
                ),
            ));
        }
        let (_, bars, rows) = all.remove(0);
        let source = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Self::from_bars_at_lines(&bars, &rows, path, &source).map_err(lines_are_rows)
    }

    /// [`Self::from_csv`] or [`Self::from_parquet`] by the file's extension.
    pub fn from_bar_file(path: &Path) -> Result<Self, Error> {
        if crate::bars::is_parquet(path) {
            Self::from_parquet(path)
        } else {
            Self::from_csv(path)
        }
    }

    /// The features of `bars` read from `path` at `lines` (each bar's line in the file): a
    /// non-finite feature is reported at the line of the first bar whose row holds it.
    pub(crate) fn from_bars_at_lines(bars: &Bars, lines: &[u64], path: &Path, source: &str) -> Result<Self, Error> {
        features::compute(bars, source).map_err(|e| match e {
            Error::NonFinite { name, row, column, value, .. } => {
                let feature = if name == "market" {
                    features::MARKET_FEATURE_NAMES.get(column).map_or(name.clone(), |n| n.to_string())
                } else {
                    name
                };
                Error::Input {
                    path: path.to_path_buf(),
                    line: lines.get(row + features::WARMUP).copied().unwrap_or(0),
                    rule: format!(
                        "the prices up to this bar make feature `{feature}` {value} (an extreme or zero price?)"
                    ),
                }
            }
            // compute names the source by file name; name the full path instead.
            Error::Format { msg, .. } => Error::format(path, msg),
            other => other,
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.close.len()
    }

    /// Number of market features per row.
    pub fn n_market(&self) -> usize {
        self.feature_names.len()
    }

    /// Checks shapes, finiteness and timestamp order; `what` names the table
    /// in errors.
    pub fn validate(&self, what: &Path) -> Result<(), Error> {
        let rows = self.rows();
        let f = self.n_market();
        let bad = |msg: String| Err(Error::format(what, msg));
        if f == 0 {
            return bad("no market feature names".into());
        }
        if self.market.len() != rows * f {
            return bad(format!("market has {} values, expected {rows} x {f}", self.market.len()));
        }
        if self.known.len() != rows * N_KNOWN {
            return bad(format!("known has {} values, expected {rows} x {N_KNOWN}", self.known.len()));
        }
        if self.logret_next.len() != rows || self.timestamp.len() != rows {
            return bad(format!(
                "logret_next/timestamp have {}/{} rows, close has {rows}",
                self.logret_next.len(),
                self.timestamp.len()
            ));
        }
        check_finite_f32(&self.market, f, "market", what)?;
        check_finite_f32(&self.known, N_KNOWN, "known", what)?;
        check_finite_f32(&self.logret_next, 1, "logret_next", what)?;
        check_finite_f64(&self.close, "close", what)?;
        check_increasing(&self.timestamp, what)
    }

    /// Writes the table as a safetensors feature file, atomically: the bytes
    /// go to a temporary file in the destination folder which is renamed over
    /// `path` only once complete, so no error leaves a partial file.
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        self.validate(path)?;
        let rows = self.rows();
        let f = self.n_market();
        let names = serde_json::to_string(&self.feature_names)
            .map_err(|e| Error::format(path, format!("feature names: {e}")))?;
        let metadata = HashMap::from([
            ("schema".to_string(), SCHEMA.to_string()),
            ("feature_names".to_string(), names),
            ("source".to_string(), self.source.clone()),
            ("rows".to_string(), rows.to_string()),
        ]);
        let tensors = [
            ("market", Raw::new(Dtype::F32, vec![rows, f], bytemuck::cast_slice(&self.market))),
            ("known", Raw::new(Dtype::F32, vec![rows, N_KNOWN], bytemuck::cast_slice(&self.known))),
            ("logret_next", Raw::new(Dtype::F32, vec![rows], bytemuck::cast_slice(&self.logret_next))),
            ("close", Raw::new(Dtype::F64, vec![rows], bytemuck::cast_slice(&self.close))),
            ("timestamp", Raw::new(Dtype::I64, vec![rows], bytemuck::cast_slice(&self.timestamp))),
        ];
        // Streamed into the temporary sibling (no second copy in memory), which
        // write_atomic_with creates with the umask's permissions, like every other file
        // fx writes, and renames over `path`.
        let mut format_error = None;
        crate::files::write_atomic_with(path, |tmp| {
            safetensors::serialize_to_file(tensors, Some(metadata), tmp).map_err(|e| match e {
                safetensors::SafeTensorError::IoError(io) => io,
                other => {
                    format_error = Some(other.to_string());
                    std::io::Error::other("cannot serialise")
                }
            })?;
            // safetensors' own temporary file is private (0600); give it what every other
            // file fx writes has.
            crate::files::set_default_permissions(tmp)?;
            std::fs::File::open(tmp)?.sync_all()
        })
        .map_err(|io| match format_error.take() {
            Some(msg) => Error::format(path, format!("cannot serialise: {msg}")),
            None => Error::io(path, io),
        })
    }
}

/// A borrowed tensor for the safetensors writer.
struct Raw<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl<'a> Raw<'a> {
    fn new(dtype: Dtype, shape: Vec<usize>, data: &'a [u8]) -> Self {
        Raw { dtype, shape, data }
    }
}

impl View for Raw<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// An error at a "line" of a Parquet file's bars (its rows, counted as lines were) as a row.
pub(crate) fn lines_are_rows(e: Error) -> Error {
    match e {
        Error::Input { path, line, rule } => Error::Row { path, row: line, rule },
        other => other,
    }
}

/// What [`build_feature_file`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureFileSummary {
    /// The file written.
    pub output: PathBuf,
    /// Bars read from the input.
    pub bars: usize,
    /// Rows written (bars minus the warm-up).
    pub rows: usize,
    /// Market features per row.
    pub n_market: usize,
    /// First and last stored timestamp (Unix seconds).
    pub first_timestamp: i64,
    /// Last stored timestamp (Unix seconds).
    pub last_timestamp: i64,
}

/// Reads OHLCV bars from `input` (a CSV, or Parquet by its extension), computes the
/// features and writes the feature file to `output` atomically (what `fx-train features` runs).
pub fn build_feature_file(input: &Path, output: &Path) -> Result<FeatureFileSummary, Error> {
    let table = FeatureTable::from_bar_file(input)?;
    table.write(output)?;
    Ok(FeatureFileSummary {
        output: output.to_path_buf(),
        bars: table.rows() + features::WARMUP,
        rows: table.rows(),
        n_market: table.n_market(),
        first_timestamp: table.timestamp[0],
        last_timestamp: table.timestamp[table.rows() - 1],
    })
}

/// One column: a byte range of the map (aligned, checked at open) or an owned copy.
#[derive(Debug)]
pub(crate) enum Col<T> {
    /// A byte range of the store's map, aligned for `T`.
    Mapped(Range<usize>),
    Owned(Vec<T>),
}

impl<T> Col<T> {
    fn owned_bytes(&self) -> usize {
        match self {
            Col::Mapped(_) => 0,
            Col::Owned(v) => std::mem::size_of_val(v.as_slice()),
        }
    }
}

/// A mapped store's columns (see [`FeatureStore::mapped`]).
pub(crate) struct MappedCols {
    pub(crate) market: Col<f32>,
    pub(crate) known: Col<f32>,
    pub(crate) logret_next: Col<f32>,
    pub(crate) close: Col<f64>,
    pub(crate) timestamp: Col<i64>,
}

/// Read access to a feature table, memory-mapped from a file or in memory.
#[derive(Debug)]
pub struct FeatureStore {
    path: PathBuf,
    /// Shared: a panel file's instruments are views of one map.
    map: Option<Arc<Mmap>>,
    rows: usize,
    n_market: usize,
    market: Col<f32>,
    known: Col<f32>,
    logret_next: Col<f32>,
    close: Col<f64>,
    timestamp: Col<i64>,
    feature_names: Vec<String>,
    source: String,
    copied_bytes: usize,
}

impl FeatureStore {
    /// Memory-maps and validates a feature file: schema tag, tensor set,
    /// dtypes, shapes, row counts (tensors and `rows` metadata agree), that
    /// every value is finite and timestamps strictly increase. A truncated or
    /// corrupt file is an [`Error::Format`] naming it.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; as with any mmap, another process
        // truncating the file underneath would fault. Feature files are
        // written by rename, so a finished file is never rewritten in place.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let bad = |msg: String| Error::format(path, msg);
        let st = SafeTensors::deserialize(&map)
            .map_err(|e| bad(format!("not a valid safetensors file (corrupt or truncated?): {e}")))?;
        let (_, meta) =
            SafeTensors::read_metadata(&map).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).ok_or_else(|| bad(format!("metadata `{k}` is missing")));
        let schema = get("schema")?;
        if schema != SCHEMA {
            return Err(bad(format!("schema is `{schema}`, expected `{SCHEMA}`")));
        }
        let feature_names: Vec<String> = serde_json::from_str(get("feature_names")?)
            .map_err(|e| bad(format!("metadata `feature_names` is not a JSON list of strings: {e}")))?;
        let source = meta.get("source").cloned().unwrap_or_default();
        let rows: usize = get("rows")?.trim().parse().map_err(|_| bad("metadata `rows` is not a count".into()))?;
        let n_market = feature_names.len();
        if n_market == 0 {
            return Err(bad("metadata `feature_names` is empty".into()));
        }
        let base = map.as_ptr() as usize;
        let mut copied = 0usize;
        let mut col = |name: &str, dtype: Dtype, shape: &[usize]| -> Result<ColRaw, Error> {
            let view = st.tensor(name).map_err(|_| bad(format!("tensor `{name}` is missing")))?;
            if view.dtype() != dtype {
                return Err(bad(format!("tensor `{name}` is {:?}, expected {dtype:?}", view.dtype())));
            }
            if view.shape() != shape {
                return Err(bad(format!(
                    "tensor `{name}` has shape {:?}, expected {shape:?} (rows = {rows})",
                    view.shape()
                )));
            }
            let data = view.data();
            let start = data.as_ptr() as usize - base;
            let aligned = (data.as_ptr() as usize).is_multiple_of(dtype.bitsize() / 8);
            if !aligned {
                copied += data.len();
            }
            Ok(ColRaw { range: start..start + data.len(), aligned })
        };
        let market = col("market", Dtype::F32, &[rows, n_market])?;
        let known = col("known", Dtype::F32, &[rows, N_KNOWN])?;
        let logret_next = col("logret_next", Dtype::F32, &[rows])?;
        let close = col("close", Dtype::F64, &[rows])?;
        let timestamp = col("timestamp", Dtype::I64, &[rows])?;
        let store = FeatureStore {
            path: path.to_path_buf(),
            rows,
            n_market,
            market: market.into_col(&map),
            known: known.into_col(&map),
            logret_next: logret_next.into_col(&map),
            close: close.into_col(&map),
            timestamp: timestamp.into_col(&map),
            feature_names,
            source,
            copied_bytes: copied,
            map: Some(Arc::new(map)),
        };
        check_finite_f32(store.market(), n_market, "market", path)?;
        check_finite_f32(store.known(), N_KNOWN, "known", path)?;
        check_finite_f32(store.logret_next(), 1, "logret_next", path)?;
        check_finite_f64(store.close(), "close", path)?;
        check_increasing(store.timestamps(), path)?;
        Ok(store)
    }

    /// A view of `rows` rows of an already validated map (a panel file's instrument):
    /// `cols` are byte ranges of `map` or owned copies.
    pub(crate) fn mapped(
        path: &Path,
        map: Arc<Mmap>,
        rows: usize,
        cols: MappedCols,
        feature_names: Vec<String>,
        source: String,
    ) -> Self {
        let owned_bytes = cols.market.owned_bytes()
            + cols.known.owned_bytes()
            + cols.logret_next.owned_bytes()
            + cols.close.owned_bytes()
            + cols.timestamp.owned_bytes();
        FeatureStore {
            path: path.to_path_buf(),
            map: Some(map),
            rows,
            n_market: feature_names.len(),
            market: cols.market,
            known: cols.known,
            logret_next: cols.logret_next,
            close: cols.close,
            timestamp: cols.timestamp,
            feature_names,
            source,
            copied_bytes: owned_bytes,
        }
    }

    /// Wraps an in-memory table (validated) so it reads like a file.
    pub fn from_table(table: FeatureTable) -> Result<Self, Error> {
        let path = PathBuf::from(format!("<in-memory table: {}>", table.source));
        table.validate(&path)?;
        Ok(FeatureStore {
            path,
            map: None,
            rows: table.rows(),
            n_market: table.n_market(),
            market: Col::Owned(table.market),
            known: Col::Owned(table.known),
            logret_next: Col::Owned(table.logret_next),
            close: Col::Owned(table.close),
            timestamp: Col::Owned(table.timestamp),
            feature_names: table.feature_names,
            source: table.source,
            copied_bytes: 0,
        })
    }

    /// Copies the rows out into an owned table.
    pub fn to_table(&self) -> FeatureTable {
        FeatureTable {
            market: self.market().to_vec(),
            known: self.known().to_vec(),
            logret_next: self.logret_next().to_vec(),
            close: self.close().to_vec(),
            timestamp: self.timestamps().to_vec(),
            feature_names: self.feature_names.clone(),
            source: self.source.clone(),
        }
    }

    fn col<'a, T: Pod>(&'a self, c: &'a Col<T>) -> &'a [T] {
        match c {
            Col::Owned(v) => v,
            // Alignment and bounds were checked when the range was made.
            Col::Mapped(r) => match &self.map {
                Some(map) => bytemuck::cast_slice(&map[r.clone()]),
                None => &[],
            },
        }
    }

    /// The file (or in-memory label) this store reads.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Market features per row.
    pub fn n_market(&self) -> usize {
        self.n_market
    }
    /// Calendar features per row (always 4).
    pub fn n_known(&self) -> usize {
        N_KNOWN
    }
    /// All market features, `[rows, n_market]` row-major.
    pub fn market(&self) -> &[f32] {
        self.col(&self.market)
    }
    /// The market features of row `i`. Panics when `i >= rows()`.
    pub fn market_row(&self, i: usize) -> &[f32] {
        &self.market()[i * self.n_market..(i + 1) * self.n_market]
    }
    /// Market features of rows `range`, row-major.
    pub fn market_rows(&self, range: Range<usize>) -> &[f32] {
        &self.market()[range.start * self.n_market..range.end * self.n_market]
    }
    /// All calendar features, `[rows, 4]` row-major.
    pub fn known(&self) -> &[f32] {
        self.col(&self.known)
    }
    /// The calendar features of row `i`.
    pub fn known_row(&self, i: usize) -> &[f32] {
        &self.known()[i * N_KNOWN..(i + 1) * N_KNOWN]
    }
    /// Next-bar log returns.
    pub fn logret_next(&self) -> &[f32] {
        self.col(&self.logret_next)
    }
    /// Close prices.
    pub fn close(&self) -> &[f64] {
        self.col(&self.close)
    }
    /// Unix-second timestamps.
    pub fn timestamps(&self) -> &[i64] {
        self.col(&self.timestamp)
    }
    /// Market feature names in column order.
    pub fn feature_names(&self) -> &[String] {
        &self.feature_names
    }
    /// The `source` metadata (input file name).
    pub fn source(&self) -> &str {
        &self.source
    }
    /// Bytes copied at open because a tensor was misaligned in the file (0 normally).
    pub fn copied_bytes(&self) -> usize {
        self.copied_bytes
    }
    /// True when the rows are read from a memory map.
    pub fn is_mapped(&self) -> bool {
        self.map.is_some()
    }
}

pub(crate) struct ColRaw {
    pub(crate) range: Range<usize>,
    pub(crate) aligned: bool,
}

impl ColRaw {
    pub(crate) fn into_col<T: Pod>(self, map: &[u8]) -> Col<T> {
        if self.aligned {
            Col::Mapped(self.range)
        } else {
            // One-time copy of a misaligned tensor (little-endian, as safetensors is).
            let bytes = &map[self.range];
            let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            Col::Owned(v)
        }
    }
}

pub(crate) fn check_finite_f32(x: &[f32], width: usize, name: &str, what: &Path) -> Result<(), Error> {
    // Fast scan first; locate the culprit only on failure.
    if x.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    let i = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
    Err(Error::NonFinite {
        path: what.to_path_buf(),
        name: name.to_string(),
        row: i / width,
        column: i % width,
        value: f64::from(x[i]),
    })
}

pub(crate) fn check_finite_f64(x: &[f64], name: &str, what: &Path) -> Result<(), Error> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => {
            Err(Error::NonFinite { path: what.to_path_buf(), name: name.to_string(), row: i, column: 0, value: x[i] })
        }
    }
}

pub(crate) fn check_increasing(ts: &[i64], what: &Path) -> Result<(), Error> {
    match ts.windows(2).position(|w| w[1] <= w[0]) {
        None => Ok(()),
        Some(i) => Err(Error::format(what, format!("timestamps are not strictly increasing at row {}", i + 1))),
    }
}

#[cfg(target_endian = "big")]
compile_error!("fx-data reads safetensors (little-endian) by reinterpreting bytes; big-endian hosts are not supported");

#[cfg(test)]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::{MARKET_FEATURE_NAMES, N_MARKET};

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures")).join(name)
    }

    fn small_table() -> FeatureTable {
        let bars = Bars::from_csv_path(&fixture("features_small.csv")).unwrap();
        FeatureTable::from_bars(&bars, "features_small.csv").unwrap()
    }

    #[test]
    fn build_write_open_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("f.safetensors");
        let s = build_feature_file(&fixture("features_small.csv"), &out).unwrap();
        assert_eq!((s.bars, s.rows, s.n_market), (400, 300, N_MARKET));
        let store = FeatureStore::open(&out).unwrap();
        assert!(store.is_mapped());
        assert_eq!(store.copied_bytes(), 0);
        let table = small_table();
        assert_eq!(store.to_table(), table);
        assert_eq!(store.rows(), 300);
        assert_eq!(store.market_row(7), &table.market[7 * N_MARKET..8 * N_MARKET]);
        assert_eq!(store.feature_names(), &MARKET_FEATURE_NAMES.map(String::from)[..]);
        assert_eq!(store.source(), "features_small.csv");
        // Rows borrow the map: the slice points into it, no copy.
        let map = store.map.as_ref().unwrap();
        let p = store.market().as_ptr() as usize;
        assert!(p >= map.as_ptr() as usize && p < map.as_ptr() as usize + map.len());
        // Only the final file is left in the folder.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // The permissions of any file fx writes (File::create's), not the temporary's 0600.
        crate::files::assert_default_permissions(&out);
        // A missing folder is named, not the temporary file.
        let (nope, target) = (dir.path().join("nope"), dir.path().join("nope").join("f.safetensors"));
        let e = small_table().write(&target).unwrap_err().to_string();
        assert_eq!(e, format!("{}: folder {} does not exist", target.display(), nope.display()));
    }

    /// A price valid by the row rules but extreme enough to overflow a feature is reported
    /// at its CSV line, not at a feature row.
    #[test]
    fn a_feature_overflow_is_reported_at_the_csv_line() {
        let dir = tempfile::tempdir().unwrap();
        let text = std::fs::read_to_string(fixture("features_small.csv")).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        // Line 151 (bar 149): open = high = low = close = 1e300.
        let mut f: Vec<String> = lines[150].split(',').map(String::from).collect();
        for v in &mut f[1..5] {
            *v = "1e300".into();
        }
        lines[150] = f.join(",");
        let path = dir.path().join("big.csv");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let e = FeatureTable::from_csv(&path).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:151: the prices up to this bar make feature", path.display())), "{e}");
    }

    #[test]
    fn bad_input_leaves_no_output() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("f.safetensors");
        let e = build_feature_file(&fixture("features_bad_nan_close.csv"), &out).unwrap_err();
        assert!(e.to_string().contains("features_bad_nan_close.csv:3:"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // Output into a missing folder: an I/O error naming it, nothing written.
        let e = build_feature_file(&fixture("features_small.csv"), &dir.path().join("no/f.st")).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
    }

    fn written_bytes() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("f.safetensors");
        small_table().write(&out).unwrap();
        std::fs::read(&out).unwrap()
    }

    fn open_bytes(bytes: &[u8]) -> Result<FeatureStore, Error> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.safetensors");
        std::fs::write(&p, bytes).unwrap();
        FeatureStore::open(&p)
    }

    #[test]
    fn truncated_files_are_clear_errors() {
        let bytes = written_bytes();
        for cut in [0, 3, 8, 100, bytes.len() / 2, bytes.len() - 1] {
            let e = open_bytes(&bytes[..cut]).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::Format { .. }) && msg.contains("bad.safetensors"), "{cut}: {msg}");
        }
    }

    #[test]
    fn corrupt_files_are_clear_errors() {
        let bytes = written_bytes();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap().to_string();
        let with_header = |h: &str| {
            let mut h = h.to_string();
            while h.len() < n {
                h.push(' ');
            }
            assert_eq!(h.len(), n, "replacement header must keep the length");
            let mut b = bytes.clone();
            b[8..8 + n].copy_from_slice(h.as_bytes());
            b
        };
        let cases = [
            (header.replace("fx-features/1", "fx-features/9"), "schema"),
            (header.replace("\"F64\"", "\"I64\""), "expected F64"),
            (header.replace("\"rows\":\"300\"", "\"rows\":\"299\""), "shape"),
            (header.replace("\"feature_names\"", "\"feature_nameX\""), "feature_names"),
            (header.replace("\"known\"", "\"knowX\""), "`known` is missing"),
            (header.replacen('{', "[", 1), "not a valid safetensors"),
        ];
        for (h, want) in cases {
            let e = open_bytes(&with_header(&h)).unwrap_err();
            assert!(e.to_string().contains(want) && e.to_string().contains("bad.safetensors"), "{want}: {e}");
        }
        // A NaN in the data is refused with its position.
        let mut b = bytes.clone();
        let off = b.len() - 4 * 300 * 4 - 4; // a value inside `market`/`known`/`logret_next`
        b[off..off + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let e = open_bytes(&b).unwrap_err();
        assert!(e.to_string().contains("non-finite"), "{e}");
    }

    #[test]
    fn misaligned_tensors_are_copied_once() {
        let bytes = written_bytes();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        // Grow the header by one space: every tensor's data moves off alignment.
        let mut b = ((n + 1) as u64).to_le_bytes().to_vec();
        b.extend_from_slice(&bytes[8..8 + n]);
        b.push(b' ');
        b.extend_from_slice(&bytes[8 + n..]);
        let store = open_bytes(&b).unwrap();
        assert_eq!(store.copied_bytes(), bytes.len() - 8 - n);
        assert_eq!(store.to_table(), small_table());
    }

    #[test]
    fn in_memory_store_matches_table_and_validates() {
        let t = small_table();
        let s = FeatureStore::from_table(t.clone()).unwrap();
        assert!(!s.is_mapped());
        assert_eq!(s.to_table(), t);
        let mut bad = t.clone();
        bad.market[5] = f32::INFINITY;
        assert!(FeatureStore::from_table(bad).is_err());
        let mut bad = t;
        bad.timestamp[3] = bad.timestamp[2];
        assert!(FeatureStore::from_table(bad).unwrap_err().to_string().contains("increasing"));
    }
}
