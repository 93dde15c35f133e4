//! A panel file (`fx-panel/1`, see [`crate::panel`]) memory-mapped: [`PanelFile::open`]
//! checks it once (schema, tensors, dtypes, shapes, the mask, finite values, the calendar:
//! a scan of the map, copying nothing unless a tensor is misaligned, which this crate's
//! writer never makes); [`PanelFile::instrument`] hands out one instrument's
//! rows as a [`FeatureStore`] that borrows the map when they are one run of calendar rows
//! (the usual case: an instrument listed after the calendar starts or delisted before it
//! ends), and gathers them once into memory only when the instrument has gaps. A run on a
//! panel of hundreds of instruments thus costs its gathered instruments, not the file
//! twice over.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytemuck::Pod;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::Error;
use crate::feature_file::{check_finite_f32, check_increasing, Col, ColRaw, MappedCols};
use crate::feature_file::{FeatureStore, FeatureTable};
use crate::features::N_KNOWN;
use crate::panel::{Panel, PANEL_SCHEMA};

/// A memory-mapped, validated panel file (see the module docs).
#[derive(Debug)]
pub struct PanelFile {
    path: PathBuf,
    map: Arc<Mmap>,
    instruments: Vec<String>,
    feature_names: Vec<String>,
    rows: usize,
    market: Raw,
    known: Raw,
    logret_next: Raw,
    close: Raw,
    mask: Raw,
    timestamp: Raw,
}

/// A tensor's bytes in the map, and whether they are aligned for its dtype.
#[derive(Debug, Clone)]
struct Raw {
    start: usize,
    len: usize,
    aligned: bool,
}

impl PanelFile {
    /// Maps and checks `path`; every error names it.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only; panel files are written by rename, never rewritten in place
        // (as for feature files, a truncation by another process would fault).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let bad = |m: String| Error::format(path, m);
        let (_, header) = SafeTensors::read_metadata(&map).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).ok_or_else(|| bad(format!("metadata lacks `{k}`")));
        if get("schema")? != PANEL_SCHEMA {
            return Err(bad(format!("schema is {:?}, expected {PANEL_SCHEMA:?}", get("schema")?)));
        }
        let list = |k: &str| -> Result<Vec<String>, Error> {
            serde_json::from_str(get(k)?).map_err(|e| bad(format!("metadata `{k}` is not a JSON list: {e}")))
        };
        let (instruments, feature_names) = (list("instruments")?, list("feature_names")?);
        if feature_names.is_empty() || instruments.is_empty() {
            return Err(bad("metadata `feature_names` and `instruments` must not be empty".into()));
        }
        let st = SafeTensors::deserialize(&map).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let n_t = st.tensor("timestamp").map_err(|e| bad(format!("tensor timestamp: {e}")))?.shape().first().copied();
        let (n_i, n_t, f) = (instruments.len(), n_t.unwrap_or(0), feature_names.len());
        if let Some(r) = meta.get("rows") {
            if r.trim().parse::<usize>().ok() != Some(n_t) {
                return Err(bad(format!("metadata `rows` is {r:?}, the calendar has {n_t} rows")));
            }
        }
        let base = map.as_ptr() as usize;
        let take = |name: &str, dtype: Dtype, shape: &[usize]| -> Result<Raw, Error> {
            let t = st.tensor(name).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            if t.dtype() != dtype || t.shape() != shape {
                return Err(bad(format!(
                    "tensor {name} is {:?} {:?}, expected {dtype:?} {shape:?}",
                    t.dtype(),
                    t.shape()
                )));
            }
            let data = t.data();
            let aligned = (data.as_ptr() as usize).is_multiple_of(dtype.bitsize() / 8);
            Ok(Raw { start: data.as_ptr() as usize - base, len: data.len(), aligned })
        };
        let market = take("market", Dtype::F32, &[n_i, n_t, f])?;
        let logret_next = take("logret_next", Dtype::F32, &[n_i, n_t])?;
        let close = take("close", Dtype::F64, &[n_i, n_t])?;
        let mask = take("mask", Dtype::U8, &[n_i, n_t])?;
        let known = take("known", Dtype::F32, &[n_t, N_KNOWN])?;
        let timestamp = take("timestamp", Dtype::I64, &[n_t])?;
        drop(st);
        let pf = PanelFile {
            path: path.to_path_buf(),
            map: Arc::new(map),
            instruments,
            feature_names,
            rows: n_t,
            market,
            known,
            logret_next,
            close,
            mask,
            timestamp,
        };
        check_increasing(&pf.values::<i64>(&pf.timestamp), path)?;
        let mask = pf.bytes(&pf.mask);
        if let Some(j) = mask.iter().position(|&m| m > 1) {
            return Err(bad(format!("mask value {} at cell {j} is not 0 or 1", mask[j])));
        }
        // Cells are named by instrument, calendar row and column, not a flat index.
        let cell = |name: &str, width: usize, j: usize, value: f64| Error::NonFinite {
            path: path.to_path_buf(),
            name: format!("{name} of instrument {}", pf.instruments[j / (n_t * width)]),
            row: (j / width) % n_t,
            column: j % width,
            value,
        };
        if let Some(j) = pf.values::<f32>(&pf.market).iter().position(|v| !v.is_finite()) {
            return Err(cell("market", f, j, f64::from(pf.values::<f32>(&pf.market)[j])));
        }
        if let Some(j) = pf.values::<f32>(&pf.logret_next).iter().position(|v| !v.is_finite()) {
            return Err(cell("logret_next", 1, j, f64::from(pf.values::<f32>(&pf.logret_next)[j])));
        }
        if let Some(j) = pf.values::<f64>(&pf.close).iter().position(|v| !v.is_finite()) {
            return Err(cell("close", 1, j, pf.values::<f64>(&pf.close)[j]));
        }
        check_finite_f32(&pf.values::<f32>(&pf.known), N_KNOWN, "known", path)?;
        Ok(pf)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Instrument names, in order.
    pub fn instruments(&self) -> &[String] {
        &self.instruments
    }
    /// Market feature names, in column order.
    pub fn feature_names(&self) -> &[String] {
        &self.feature_names
    }
    /// Calendar rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// The calendar's timestamps (borrowed from the map when aligned).
    pub fn timestamps(&self) -> Cow<'_, [i64]> {
        self.values(&self.timestamp)
    }

    fn bytes(&self, r: &Raw) -> &[u8] {
        &self.map[r.start..r.start + r.len]
    }

    /// A tensor's values: borrowed when aligned, else copied.
    fn values<T: Pod>(&self, r: &Raw) -> Cow<'_, [T]> {
        let b = self.bytes(r);
        if r.aligned {
            Cow::Borrowed(bytemuck::cast_slice(b))
        } else {
            let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
            Cow::Owned(v)
        }
    }

    /// Elements `first..first + n` of tensor `r` (elements of `T`) as a store column:
    /// mapped in place when aligned, else copied.
    fn column<T: Pod>(&self, r: &Raw, first: usize, n: usize) -> Col<T> {
        let size = std::mem::size_of::<T>();
        let range = r.start + first * size..r.start + (first + n) * size;
        ColRaw { range, aligned: r.aligned }.into_col(&self.map)
    }

    /// Instrument `i`'s own rows (its unmasked cells in time order: exactly the
    /// single-instrument table of its bars, as [`Panel::instrument`] gives it) and the
    /// calendar row of each. The store borrows the map when the rows are one run of
    /// calendar rows ([`FeatureStore::is_mapped`]), else holds a gathered copy.
    pub fn instrument(&self, i: usize) -> Result<(FeatureStore, Vec<usize>), Error> {
        let Some(name) = self.instruments.get(i) else {
            return Err(Error::config("panel instrument", format!("{i} of {} instruments", self.instruments.len())));
        };
        let (n_t, f) = (self.rows, self.feature_names.len());
        let mask = &self.bytes(&self.mask)[i * n_t..(i + 1) * n_t];
        let rows: Vec<usize> = (0..n_t).filter(|&c| mask[c] == 1).collect();
        if let (Some(&a), Some(&z)) = (rows.first(), rows.last()) {
            if z - a + 1 == rows.len() {
                let (n, cell) = (rows.len(), i * n_t + a);
                let cols = MappedCols {
                    market: self.column(&self.market, cell * f, n * f),
                    known: self.column(&self.known, a * N_KNOWN, n * N_KNOWN),
                    logret_next: self.column(&self.logret_next, cell, n),
                    close: self.column(&self.close, cell, n),
                    timestamp: self.column(&self.timestamp, a, n),
                };
                let store = FeatureStore::mapped(
                    &self.path,
                    self.map.clone(),
                    n,
                    cols,
                    self.feature_names.clone(),
                    name.clone(),
                );
                return Ok((store, rows));
            }
        }
        let table = self.gather(i, &rows);
        Ok((FeatureStore::from_table(table)?, rows))
    }

    /// Instrument `i`'s cells at calendar rows `rows`, copied into a table.
    fn gather(&self, i: usize, rows: &[usize]) -> FeatureTable {
        let (n_t, f) = (self.rows, self.feature_names.len());
        let (market, known) = (self.values::<f32>(&self.market), self.values::<f32>(&self.known));
        let (logret, close) = (self.values::<f32>(&self.logret_next), self.values::<f64>(&self.close));
        let ts = self.values::<i64>(&self.timestamp);
        let cell = |c: usize| i * n_t + c;
        FeatureTable {
            market: rows.iter().flat_map(|&c| market[cell(c) * f..(cell(c) + 1) * f].iter().copied()).collect(),
            known: rows.iter().flat_map(|&c| known[c * N_KNOWN..(c + 1) * N_KNOWN].iter().copied()).collect(),
            logret_next: rows.iter().map(|&c| logret[cell(c)]).collect(),
            close: rows.iter().map(|&c| close[cell(c)]).collect(),
            timestamp: rows.iter().map(|&c| ts[c]).collect(),
            feature_names: self.feature_names.clone(),
            source: self.instruments[i].clone(),
        }
    }

    /// The whole panel, copied into memory.
    pub fn to_panel(&self) -> Panel {
        Panel {
            instruments: self.instruments.clone(),
            feature_names: self.feature_names.clone(),
            timestamp: self.values::<i64>(&self.timestamp).into_owned(),
            market: self.values::<f32>(&self.market).into_owned(),
            known: self.values::<f32>(&self.known).into_owned(),
            logret_next: self.values::<f32>(&self.logret_next).into_owned(),
            close: self.values::<f64>(&self.close).into_owned(),
            mask: self.bytes(&self.mask).to_vec(),
        }
    }
}

#[cfg(test)]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bars::Bars;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures")).join(name)
    }

    /// Three instruments of one fixture's bars on calendars that differ: `a` all of them,
    /// `b` a later start (one run of rows), `c` with every 7th bar missing (gaps).
    fn panel() -> Panel {
        let bars = Bars::from_csv_path(&fixture("features_small.csv")).unwrap();
        let keep = |f: &dyn Fn(usize) -> bool| {
            let idx: Vec<usize> = (0..bars.len()).filter(|&i| f(i)).collect();
            Bars {
                timestamp: idx.iter().map(|&i| bars.timestamp[i]).collect(),
                open: idx.iter().map(|&i| bars.open[i]).collect(),
                high: idx.iter().map(|&i| bars.high[i]).collect(),
                low: idx.iter().map(|&i| bars.low[i]).collect(),
                close: idx.iter().map(|&i| bars.close[i]).collect(),
                volume: idx.iter().map(|&i| bars.volume[i]).collect(),
            }
        };
        let table = |b: Bars, n: &str| (n.to_string(), FeatureTable::from_bars(&b, n).unwrap());
        Panel::from_tables(vec![
            table(keep(&|_| true), "a"),
            table(keep(&|i| i >= 150), "b"),
            table(keep(&|i| i % 7 != 3), "c"),
        ])
        .unwrap()
    }

    /// Each instrument out of the mapped file is the in-memory panel's, cell for cell; the
    /// one-run instruments borrow the map (nothing copied), the gapped one is gathered; the
    /// whole file reads back as the panel written.
    #[test]
    fn instruments_are_views_of_the_map_when_their_rows_are_one_run() {
        let p = panel();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        p.write(&path).unwrap();
        let pf = PanelFile::open(&path).unwrap();
        assert_eq!(pf.to_panel(), p);
        assert_eq!(pf.instruments(), &p.instruments[..]);
        assert_eq!(&pf.timestamps()[..], &p.timestamp[..]);
        for i in 0..3 {
            let (table, rows) = p.instrument(i).unwrap();
            let (store, got) = pf.instrument(i).unwrap();
            assert_eq!(got, rows, "instrument {i}");
            assert_eq!(store.to_table(), table, "instrument {i}");
            let one_run = rows.last().unwrap() - rows[0] + 1 == rows.len();
            assert_eq!(store.is_mapped(), one_run, "instrument {i}");
            if one_run {
                assert_eq!(store.copied_bytes(), 0, "instrument {i}");
            }
        }
        assert!(pf.instrument(0).unwrap().0.is_mapped() && pf.instrument(1).unwrap().0.is_mapped());
        assert!(!pf.instrument(2).unwrap().0.is_mapped());
        assert!(pf.instrument(3).is_err());
    }

    /// Damage the reader must refuse, each naming the file: a truncated file, a NaN cell, a
    /// mask value of 2, a feature file.
    #[test]
    fn damaged_panel_files_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = panel();
        let path = dir.path().join("p.safetensors");
        p.write(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        std::fs::write(&path, &good[..good.len() - 9]).unwrap();
        let e = PanelFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("p.safetensors") && !e.contains('\n'), "{e}");
        p.market[5] = f32::NAN;
        p.write(&path).unwrap();
        let e = PanelFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("p.safetensors") && e.contains("market of instrument a"), "{e}");
        p.market[5] = 0.0;
        p.mask[2] = 2;
        p.write(&path).unwrap();
        let e = PanelFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("mask value 2"), "{e}");
        let not_panel = dir.path().join("f.safetensors");
        crate::build_feature_file(&fixture("features_small.csv"), &not_panel).unwrap();
        let e = PanelFile::open(&not_panel).unwrap_err().to_string();
        assert!(e.contains("f.safetensors") && (e.contains("schema is") || e.contains("lacks")), "{e}");
    }
}
