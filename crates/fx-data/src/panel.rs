//! Panels: many instruments' features on one calendar, `[instrument × time × feature]`.
//!
//! [`Panel::from_csv_dir`] reads a folder of per-instrument bar files (`*.csv`, one
//! instrument each, named by its file stem, in name order), [`Panel::from_long_csv`] one
//! long-format file (a symbol column beside the bar columns, instruments by name), computes each instrument's
//! features exactly as for a single instrument ([`crate::features::compute`]: the same
//! leakage rules, each instrument's look-back inside its own bars), and aligns them on the
//! union of their feature rows' timestamps. Where an instrument has no row at a timestamp
//! its `mask` is 0 and its values are 0: a missing bar is masked, never forward-filled.
//! Nothing of one instrument enters another's values.
//!
//! The file (`fx-panel/1`, safetensors, readable by Python's `safetensors`): `market` F32
//! `[I, T, F]`, `logret_next` F32 `[I, T]`, `close` F64 `[I, T]`, `mask` U8 `[I, T]`,
//! `known` F32 `[T, 4]` (the calendar's own features), `timestamp` I64 `[T]`; metadata
//! `schema`, `instruments` and `feature_names` (JSON lists), `rows` (T). Written atomically.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::error::Error;
use crate::feature_file::FeatureTable;
use crate::features::{calendar, N_KNOWN};
use crate::normalize::Normalizer;

/// The `schema` metadata value of a panel file.
pub const PANEL_SCHEMA: &str = "fx-panel/1";

/// Many instruments' features on one calendar (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// Instrument names (file stems), in order.
    pub instruments: Vec<String>,
    /// Market feature names, in column order (every instrument's).
    pub feature_names: Vec<String>,
    /// The calendar: every instrument's feature-row timestamps, merged, strictly increasing.
    pub timestamp: Vec<i64>,
    /// `[I, T, F]` row-major; 0 where masked.
    pub market: Vec<f32>,
    /// Calendar features of each timestamp, `[T, 4]`.
    pub known: Vec<f32>,
    /// `[I, T]`: the instrument's `ln(c_{t+1}/c_t)` at its own next bar; 0 where masked.
    pub logret_next: Vec<f32>,
    /// `[I, T]` close prices; 0 where masked.
    pub close: Vec<f64>,
    /// `[I, T]`: 1 where the instrument has a feature row at that timestamp.
    pub mask: Vec<u8>,
}

impl Panel {
    /// Number of calendar rows.
    pub fn rows(&self) -> usize {
        self.timestamp.len()
    }

    /// Market features per row.
    pub fn n_market(&self) -> usize {
        self.feature_names.len()
    }

    /// Aligns per-instrument feature tables (named) on the union of their timestamps.
    pub fn from_tables(tables: Vec<(String, FeatureTable)>) -> Result<Self, Error> {
        let what = Path::new("panel");
        let Some((_, first)) = tables.first() else {
            return Err(Error::format(what, "a panel needs at least one instrument"));
        };
        let feature_names = first.feature_names.clone();
        let mut seen = BTreeSet::new();
        for (name, t) in &tables {
            if t.feature_names != feature_names {
                return Err(Error::format(
                    what,
                    format!("instrument {name}: its feature names differ from the first's"),
                ));
            }
            if !seen.insert(name.clone()) {
                return Err(Error::format(what, format!("instrument {name} appears twice")));
            }
        }
        let calendar_ts: Vec<i64> =
            tables.iter().flat_map(|(_, t)| t.timestamp.iter().copied()).collect::<BTreeSet<_>>().into_iter().collect();
        let at: HashMap<i64, usize> = calendar_ts.iter().enumerate().map(|(i, &ts)| (ts, i)).collect();
        let (n_i, n_t, f) = (tables.len(), calendar_ts.len(), feature_names.len());
        // Instruments whose dates barely overlap make the union calendar long: the aligned
        // cells can outgrow memory though every instrument's own table fits.
        check_fits(aligned_bytes(n_i, n_t, f), fx_hw::HostInfo::detect().memory_limit(), n_i, n_t)?;
        let mut market = zeroed::<f32>(n_i * n_t * f)?;
        let mut logret_next = zeroed::<f32>(n_i * n_t)?;
        let mut close = zeroed::<f64>(n_i * n_t)?;
        let mut mask = zeroed::<u8>(n_i * n_t)?;
        for (i, (_, t)) in tables.iter().enumerate() {
            for (r, ts) in t.timestamp.iter().enumerate() {
                let c = at[ts];
                let cell = i * n_t + c;
                market[cell * f..(cell + 1) * f].copy_from_slice(&t.market[r * f..(r + 1) * f]);
                logret_next[cell] = t.logret_next[r];
                close[cell] = t.close[r];
                mask[cell] = 1;
            }
        }
        let known = calendar_ts.iter().flat_map(|&ts| calendar(ts).map(|x| x as f32)).collect();
        Ok(Panel {
            instruments: tables.into_iter().map(|(n, _)| n).collect(),
            feature_names,
            timestamp: calendar_ts,
            market,
            known,
            logret_next,
            close,
            mask,
        })
    }

    /// Reads every `*.csv` and `*.parquet` (`*.pq`) in `dir` (an instrument each, by file
    /// stem, in name order) and builds the panel; a bad file's error names it, its line (or
    /// row) and rule as for one instrument. Two files of one stem are refused.
    pub fn from_csv_dir(dir: &Path) -> Result<Self, Error> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) || crate::bars::is_parquet(p))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::format(dir, "holds no .csv or .parquet bar files"));
        }
        let mut tables: Vec<(String, FeatureTable)> = Vec::with_capacity(files.len());
        for p in &files {
            let name = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            if tables.iter().any(|(n, _)| *n == name) {
                return Err(Error::format(p, format!("a second bar file of instrument `{name}` in {}", dir.display())));
            }
            tables.push((name, FeatureTable::from_bar_file(p)?));
        }
        Self::from_tables(tables)
    }

    /// Reads a Parquet bar file with a symbol column (long format; see
    /// [`crate::bars::read_parquet`]) and builds the panel, instruments by name; a bad row's
    /// error names the file, its row, the instrument and the rule.
    pub fn from_parquet(path: &Path) -> Result<Self, Error> {
        Self::from_instrument_bars(path, crate::bars::read_parquet(path)?).map_err(crate::feature_file::lines_are_rows)
    }

    /// Features per instrument of bars read from `path` (each bar's line, or row), then the panel.
    /// Instruments are independent, so their features are computed on every usable CPU within
    /// the user's thread cap ([`fx_hw::par_map`]; data preparation, never a decision
    /// path), in chunks of consecutive instruments; the tables
    /// keep the instruments' order and an error is the first failing instrument's in that
    /// order, as one after another would give.
    fn from_instrument_bars(path: &Path, instruments: Vec<(String, crate::Bars, Vec<u64>)>) -> Result<Self, Error> {
        let file = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let one = |(name, bars, lines): &(String, crate::Bars, Vec<u64>)| -> Result<(String, FeatureTable), Error> {
            let source = format!("{file}:{name}");
            let t = FeatureTable::from_bars_at_lines(bars, lines, path, &source).map_err(|e| match e {
                Error::Input { path, line, rule } => Error::Input { path, line, rule: format!("{name}: {rule}") },
                other => other,
            })?;
            Ok((name.clone(), t))
        };
        let parts = fx_hw::par_map(&instruments, one)
            .map_err(|e| Error::Format { path: path.to_path_buf(), msg: format!("computing features: {e}") })?;
        let tables = parts.into_iter().collect::<Result<Vec<_>, Error>>()?;
        drop(instruments);
        Self::from_tables(tables)
    }

    /// Reads a long-format CSV of many instruments (`timestamp, symbol, open, high, low,
    /// close, volume`, any column order, rows in any order across instruments; see
    /// [`crate::bars::read_long_csv`]) and builds the panel, instruments by name. Each
    /// instrument's features are its own bars' (as [`Self::from_csv_dir`] with one file per
    /// instrument gives); a bad row's error names the file, its line, the instrument and the rule.
    pub fn from_long_csv(path: &Path) -> Result<Self, Error> {
        Self::from_instrument_bars(path, crate::bars::read_long_csv(path)?)
    }

    /// One normaliser per instrument, fitted on the calendar rows `train` only (DATA.md:
    /// never on validation or test rows) over that instrument's own unmasked cells there: an
    /// instrument's scale never mixes with another's, and a cell without a bar counts for
    /// nothing. An instrument with no bar in `train` is an error naming it.
    pub fn fit_normalizers(&self, train: Range<usize>) -> Result<Vec<Normalizer>, Error> {
        let (n_t, f) = (self.rows(), self.n_market());
        if train.end > n_t || train.is_empty() {
            return Err(Error::config("panel normalisation rows", format!("{train:?} of {n_t} calendar rows")));
        }
        self.instruments
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let cells: Vec<usize> =
                    train.clone().map(|c| i * n_t + c).filter(|&cell| self.mask[cell] == 1).collect();
                if cells.is_empty() {
                    return Err(Error::config(
                        "panel normalisation rows",
                        format!("instrument {name} has no bar in calendar rows {train:?}"),
                    ));
                }
                let rows: Vec<f32> =
                    cells.iter().flat_map(|&cell| self.market[cell * f..(cell + 1) * f].iter().copied()).collect();
                Normalizer::fit_rows(&rows, f, 0..cells.len())
            })
            .collect()
    }

    /// Normalises every instrument's unmasked cells with its own normaliser (from
    /// [`Self::fit_normalizers`]); masked cells stay 0.
    pub fn normalize(&mut self, norms: &[Normalizer]) -> Result<(), Error> {
        let (n_t, f) = (self.rows(), self.n_market());
        if norms.len() != self.instruments.len() || norms.iter().any(|n| n.width() != f) {
            return Err(Error::config(
                "panel normalisers",
                format!("{} normalisers for {} instruments of {f} features", norms.len(), self.instruments.len()),
            ));
        }
        for (i, norm) in norms.iter().enumerate() {
            for cell in i * n_t..(i + 1) * n_t {
                if self.mask[cell] == 1 {
                    norm.apply_in_place(&mut self.market[cell * f..(cell + 1) * f]);
                }
            }
        }
        Ok(())
    }

    /// Writes the panel file (see the module docs) atomically.
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        let (n_i, n_t, f) = (self.instruments.len(), self.rows(), self.n_market());
        let json = |v: &[String]| serde_json::to_string(v).map_err(|e| Error::format(path, e.to_string()));
        let metadata = HashMap::from([
            ("schema".to_string(), PANEL_SCHEMA.to_string()),
            ("instruments".to_string(), json(&self.instruments)?),
            ("feature_names".to_string(), json(&self.feature_names)?),
            ("rows".to_string(), n_t.to_string()),
        ]);
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = [
            ("market", Dtype::F32, vec![n_i, n_t, f], bytemuck::cast_slice::<f32, u8>(&self.market)),
            ("logret_next", Dtype::F32, vec![n_i, n_t], bytemuck::cast_slice(&self.logret_next)),
            ("close", Dtype::F64, vec![n_i, n_t], bytemuck::cast_slice(&self.close)),
            ("mask", Dtype::U8, vec![n_i, n_t], &self.mask[..]),
            ("known", Dtype::F32, vec![n_t, N_KNOWN], bytemuck::cast_slice(&self.known)),
            ("timestamp", Dtype::I64, vec![n_t], bytemuck::cast_slice(&self.timestamp)),
        ]
        .into_iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(d, s, b)
                .map(|v| (n, v))
                .map_err(|e| Error::format(path, format!("tensor {n}: {e}")))
        })
        .collect::<Result<_, _>>()?;
        // Streamed from the tensors to the file (no second copy of the panel in memory):
        // safetensors writes the temporary sibling through a temporary of its own (private
        // permissions, not synced), so it gets the umask's permissions and is synced here
        // before the rename over `path`.
        crate::files::write_atomic_with(path, |tmp| {
            safetensors::tensor::serialize_to_file(views, Some(metadata), tmp).map_err(|e| match e {
                safetensors::SafeTensorError::IoError(e) => e,
                e => std::io::Error::other(e.to_string()),
            })?;
            crate::files::set_default_permissions(tmp)?;
            std::fs::File::open(tmp)?.sync_all()
        })
        .map_err(|e| Error::io(path, e))
    }

    /// Reads a panel file into memory, checking its schema, tensors, shapes, dtypes, mask,
    /// values and calendar ([`crate::PanelFile`] reads it without copying).
    pub fn read(path: &Path) -> Result<Self, Error> {
        Ok(crate::PanelFile::open(path)?.to_panel())
    }
}

impl Panel {
    /// Reads whatever `path` holds as a panel: a folder of per-instrument bar files, a
    /// long-format CSV or Parquet file, or a panel file (`fx-panel/1`). `None` when it is one
    /// instrument's data (a bar file of one symbol, or a feature file).
    pub fn load(path: &Path) -> Result<Option<Self>, Error> {
        if path.is_dir() {
            return Self::from_csv_dir(path).map(Some);
        }
        if crate::bars::is_parquet(path) {
            let all = crate::bars::read_parquet(path)?;
            return if all.len() > 1 {
                Self::from_instrument_bars(path, all).map(Some).map_err(crate::feature_file::lines_are_rows)
            } else {
                Ok(None)
            };
        }
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) {
            return if crate::bars::is_long_format(path)? { Self::from_long_csv(path).map(Some) } else { Ok(None) };
        }
        if is_panel_file(path)? {
            return Self::read(path).map(Some);
        }
        Ok(None)
    }

    /// Instrument `i` alone: its own feature rows (the unmasked cells, in time order, exactly
    /// the single-instrument table of its bars) and the calendar row of each.
    pub fn instrument(&self, i: usize) -> Result<(FeatureTable, Vec<usize>), Error> {
        let Some(name) = self.instruments.get(i) else {
            return Err(Error::config("panel instrument", format!("{i} of {} instruments", self.instruments.len())));
        };
        let (n_t, f) = (self.rows(), self.n_market());
        let rows: Vec<usize> = (0..n_t).filter(|&c| self.mask[i * n_t + c] == 1).collect();
        let cell = |c: usize| i * n_t + c;
        let table = FeatureTable {
            market: rows.iter().flat_map(|&c| self.market[cell(c) * f..(cell(c) + 1) * f].iter().copied()).collect(),
            known: rows.iter().flat_map(|&c| self.known[c * N_KNOWN..(c + 1) * N_KNOWN].iter().copied()).collect(),
            logret_next: rows.iter().map(|&c| self.logret_next[cell(c)]).collect(),
            close: rows.iter().map(|&c| self.close[cell(c)]).collect(),
            timestamp: rows.iter().map(|&c| self.timestamp[c]).collect(),
            feature_names: self.feature_names.clone(),
            source: name.clone(),
        };
        Ok((table, rows))
    }
}

/// Whether `path` is a safetensors file whose metadata says `fx-panel/1` (reads the header
/// only; anything that is not safetensors is not a panel file).
pub fn is_panel_file(path: &Path) -> Result<bool, Error> {
    use std::io::Read;
    let mut f = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
    let mut len = [0u8; 8];
    if f.read_exact(&mut len).is_err() {
        return Ok(false);
    }
    let n = u64::from_le_bytes(len);
    // A header is JSON of a few KiB; anything implausible is not ours to judge here.
    if n > 1 << 24 {
        return Ok(false);
    }
    let mut head = vec![0u8; n as usize];
    if f.read_exact(&mut head).is_err() {
        return Ok(false);
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&head) else { return Ok(false) };
    Ok(v["__metadata__"]["schema"].as_str() == Some(PANEL_SCHEMA))
}

/// Bytes of a panel of `n_i` instruments aligned on `n_t` dates with `f` features: per cell
/// its features (F32), next return (F32), close (F64) and mask (U8); per date the calendar
/// features and timestamp.
fn aligned_bytes(n_i: usize, n_t: usize, f: usize) -> u64 {
    let cell = 4 * f as u64 + 4 + 8 + 1;
    let cells = (n_i as u64).saturating_mul(n_t as u64).saturating_mul(cell);
    cells.saturating_add((n_t as u64).saturating_mul(4 * N_KNOWN as u64 + 8))
}

/// Refuses an aligned panel of more than half of `limit` (the process's memory limit and
/// what it is, [`fx_hw::HostInfo::memory_limit`]; no check when unknown), in one line with
/// the sizes that make it.
fn check_fits(bytes: u64, limit: Option<(u64, &str)>, n_i: usize, n_t: usize) -> Result<(), Error> {
    let Some((limit, what)) = limit else { return Ok(()) };
    if bytes > limit / 2 {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        return Err(Error::format(
            "panel",
            format!(
                "{n_i} instruments aligned on the union of their dates ({n_t} dates) need {:.1} GiB, more than half of \
                 {what} ({:.1} GiB): do the instruments' dates overlap?",
                gib(bytes),
                gib(limit)
            ),
        ));
    }
    Ok(())
}

/// `n` zeroed values, reserved fallibly (an address-space limit is an error, not an abort).
fn zeroed<T: Clone + Default>(n: usize) -> Result<Vec<T>, Error> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::format(
            "panel",
            format!("{} bytes of aligned cells do not fit in this process's memory", n.saturating_mul(size_of::<T>())),
        )
    })?;
    v.resize(n, T::default());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bars::Bars;

    /// The aligned panel's size is checked before its cells are allocated: a union
    /// calendar that would take more than half of the memory is refused in one line.
    #[test]
    fn an_aligned_panel_larger_than_memory_is_refused() {
        let b = aligned_bytes(1000, 60_000, 51);
        assert_eq!(b, 1000 * 60_000 * (4 * 51 + 13) + 60_000 * (4 * N_KNOWN as u64 + 8));
        let ram = "this machine's memory";
        assert!(check_fits(b, Some((2 * b, ram)), 1000, 60_000).is_ok());
        assert!(check_fits(b, None, 1000, 60_000).is_ok());
        let e = check_fits(b, Some((2 * b - 2, ram)), 1000, 60_000).unwrap_err().to_string();
        assert!(e.contains("1000 instruments") && e.contains("60000 dates") && !e.contains('\n'), "{e}");
        assert!(e.contains("more than half of this machine's memory"), "{e}");
        assert_eq!(aligned_bytes(usize::MAX, usize::MAX, 51), u64::MAX);
        assert_eq!(zeroed::<f64>(3).unwrap(), vec![0.0; 3]);
        assert!(zeroed::<f64>(usize::MAX / 4).unwrap_err().to_string().contains("do not fit"));
    }

    fn data(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data")).join(name)
    }

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures")).join(name)
    }

    /// The three shipped stocks: each instrument's cells equal its single-instrument
    /// features bit for bit, and the file reads back to the same panel.
    #[test]
    fn panel_cells_are_each_instruments_own_features() {
        let dir = tempfile::tempdir().unwrap();
        for s in ["aapl", "ibm", "msft"] {
            let name = format!("{s}_daily_2000_2013.csv");
            std::fs::copy(data(&name), dir.path().join(&name)).unwrap();
        }
        let p = Panel::from_csv_dir(dir.path()).unwrap();
        assert_eq!(p.instruments, ["aapl_daily_2000_2013", "ibm_daily_2000_2013", "msft_daily_2000_2013"]);
        let (n_t, f) = (p.rows(), p.n_market());
        for (i, inst) in p.instruments.iter().enumerate() {
            let bars = Bars::from_csv_path(&dir.path().join(format!("{inst}.csv"))).unwrap();
            let t = FeatureTable::from_bars(&bars, "x").unwrap();
            let mut r = 0;
            for c in 0..n_t {
                let cell = i * n_t + c;
                if p.mask[cell] == 0 {
                    assert!(p.market[cell * f..(cell + 1) * f].iter().all(|&x| x == 0.0) && p.close[cell] == 0.0);
                    continue;
                }
                assert_eq!(p.timestamp[c], t.timestamp[r]);
                let (a, b) = (&p.market[cell * f..(cell + 1) * f], &t.market[r * f..(r + 1) * f]);
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{inst} row {r}");
                assert_eq!(p.close[cell].to_bits(), t.close[r].to_bits());
                assert_eq!(p.logret_next[cell].to_bits(), t.logret_next[r].to_bits());
                r += 1;
            }
            assert_eq!(r, t.rows(), "{inst}: every row placed once");
        }
        let out = tempfile::tempdir().unwrap();
        let path = out.path().join("panel.safetensors");
        p.write(&path).unwrap();
        assert_eq!(Panel::read(&path).unwrap(), p);
        // Streamed to the file through two temporaries: only the file is left in the folder,
        // with the permissions of any file fx writes (File::create's), not a temporary's 0600.
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1);
        crate::files::assert_default_permissions(&path);
        let e = p.write(&out.path().join("nope").join("p.safetensors")).unwrap_err().to_string();
        assert!(e.contains("folder") && e.contains("nope") && e.contains("does not exist"), "{e}");
    }

    /// An instrument taken out of a panel is its own single-instrument table, and `load`
    /// reads folders, long CSVs and panel files alike.
    #[test]
    fn an_instrument_out_of_a_panel_is_its_own_table() {
        let (full, gappy) = full_and_gappy(40..55);
        let p = Panel::from_tables(vec![("a".into(), full.clone()), ("b".into(), gappy.clone())]).unwrap();
        for (i, want) in [full, gappy].into_iter().enumerate() {
            let (got, rows) = p.instrument(i).unwrap();
            assert_eq!(rows.len(), want.rows());
            assert!(rows.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(
                got.market.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.market.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            assert_eq!((got.close, got.timestamp, got.known), (want.close, want.timestamp, want.known));
            assert_eq!(got.logret_next, want.logret_next);
        }
        assert!(p.instrument(2).is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.safetensors");
        p.write(&path).unwrap();
        assert!(is_panel_file(&path).unwrap());
        assert_eq!(Panel::load(&path).unwrap(), Some(p.clone()));
        let one = dir.path().join("one.safetensors");
        p.instrument(0).unwrap().0.write(&one).unwrap();
        assert!(!is_panel_file(&one).unwrap());
        assert_eq!(Panel::load(&one).unwrap(), None);
        assert_eq!(Panel::load(&data("msft_daily_2000_2013.csv")).unwrap(), None);
    }

    /// The fixture's features, and the features of the same bars without those in `gap`.
    fn full_and_gappy(gap: Range<usize>) -> (FeatureTable, FeatureTable) {
        let bars = Bars::from_csv_path(&fixture("features_small.csv")).unwrap();
        let keep: Vec<usize> = (0..bars.len()).filter(|i| !gap.contains(i)).collect();
        let pick = |v: &[f64]| keep.iter().map(|&i| v[i]).collect::<Vec<_>>();
        let gappy = Bars {
            timestamp: keep.iter().map(|&i| bars.timestamp[i]).collect(),
            open: pick(&bars.open),
            high: pick(&bars.high),
            low: pick(&bars.low),
            close: pick(&bars.close),
            volume: pick(&bars.volume),
        };
        (FeatureTable::from_bars(&bars, "a").unwrap(), FeatureTable::from_bars(&gappy, "b").unwrap())
    }

    /// Calendars that differ: the missing bars are masked, not filled, and the other
    /// instrument's values are the same as alone (nothing leaks across instruments).
    #[test]
    fn missing_bars_are_masked_and_nothing_leaks() {
        // The second instrument lacks 20 bars in the middle (its features are its own).
        let (full, gap) = full_and_gappy(200..220);
        let p = Panel::from_tables(vec![("a".into(), full.clone()), ("b".into(), gap.clone())]).unwrap();
        assert_eq!(p.rows(), full.rows(), "b's timestamps are a subset of a's");
        let n_t = p.rows();
        assert_eq!(p.mask[..n_t].iter().filter(|&&m| m == 1).count(), full.rows());
        assert_eq!(p.mask[n_t..].iter().filter(|&&m| m == 0).count(), 20);
        // Instrument a is exactly its own table.
        let f = p.n_market();
        assert!(p.market[..n_t * f].iter().zip(&full.market).all(|(x, y)| x.to_bits() == y.to_bits()));
        // Instrument b alone equals its cells.
        let cells: Vec<usize> = (0..n_t).filter(|&c| p.mask[n_t + c] == 1).collect();
        assert_eq!(cells.len(), gap.rows());
        for (r, &c) in cells.iter().enumerate() {
            let cell = n_t + c;
            assert_eq!(&p.market[cell * f..(cell + 1) * f], &gap.market[r * f..(r + 1) * f]);
        }
        assert!(Panel::from_tables(vec![("a".into(), full.clone()), ("a".into(), full)]).is_err());
    }

    /// The three shipped stocks as one long-format file (rows interleaved by date, columns
    /// reordered, the symbol column named `ticker`): the same panel as the folder of their
    /// files, bit for bit, instrument names aside.
    #[test]
    fn a_long_format_file_is_the_folders_panel() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["aapl", "ibm", "msft"];
        let mut rows: Vec<(String, String, String)> = Vec::new();
        for s in names {
            let name = format!("{s}_daily_2000_2013.csv");
            std::fs::copy(data(&name), dir.path().join(format!("{s}.csv"))).unwrap();
            let text = std::fs::read_to_string(data(&name)).unwrap();
            for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
                let (date, rest) = line.split_once(',').unwrap();
                rows.push((date.to_string(), s.to_uppercase(), rest.to_string()));
            }
        }
        rows.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        let mut long = String::from("date,ticker,open,high,low,close,volume\n");
        for (d, sym, rest) in &rows {
            long.push_str(&format!("{d},{sym},{rest}\n"));
        }
        let long_path = dir.path().join("universe.long");
        std::fs::write(&long_path, long).unwrap();
        let folder = Panel::from_csv_dir(dir.path()).unwrap();
        let mut p = Panel::from_long_csv(&long_path).unwrap();
        assert_eq!(p.instruments, ["AAPL", "IBM", "MSFT"]);
        p.instruments = folder.instruments.clone();
        assert!(p == folder, "the long-format panel differs from the folder's");
        // One instrument's bars read alone from a long file are refused, naming the line of
        // the second instrument.
        let e = Bars::from_csv_path(&long_path).unwrap_err().to_string();
        assert!(e.contains("universe.long:3") && e.contains("a second instrument") && !e.contains('\n'), "{e}");
    }

    /// Long-format errors name the file, the line, the instrument and the rule, in one line.
    #[test]
    fn bad_long_format_rows_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let bars = Bars::from_csv_path(&fixture("features_small.csv")).unwrap();
        let write = |name: &str, edit: &dyn Fn(&mut Vec<String>)| -> PathBuf {
            let mut lines = vec!["timestamp,symbol,open,high,low,close,volume".to_string()];
            for i in 0..bars.len() {
                for sym in ["A", "B"] {
                    let (o, h, l, c, v) = (bars.open[i], bars.high[i], bars.low[i], bars.close[i], bars.volume[i]);
                    lines.push(format!("{},{sym},{o},{h},{l},{c},{v}", bars.timestamp[i]));
                }
            }
            edit(&mut lines);
            let p = dir.path().join(name);
            std::fs::write(&p, lines.join("\n")).unwrap();
            p
        };
        let ok = write("ok.csv", &|_| {});
        let p = Panel::from_long_csv(&ok).unwrap();
        assert_eq!((p.instruments.len(), p.mask.iter().all(|&m| m == 1)), (2, true));
        type Edit<'a> = &'a dyn Fn(&mut Vec<String>);
        let cases: [(&str, Edit, &str); 4] = [
            // B's row at line 5 goes back in time (A's rows do not count for B).
            (
                "back.csv",
                &|l| l[4] = l[4].replacen(&bars.timestamp[1].to_string(), "0", 1),
                "back.csv:5: B: timestamps must be strictly increasing",
            ),
            (
                "nan.csv",
                &|l| {
                    let mut f: Vec<String> = l[7].split(',').map(String::from).collect();
                    f[2] = "nan".into();
                    l[7] = f.join(",");
                },
                "nan.csv:8: A: prices must be finite and positive (open = nan)",
            ),
            ("empty.csv", &|l| l[2] = l[2].replace(",B,", ",,"), "empty.csv:3: the symbol is empty"),
            ("short.csv", &|l| l.push(format!("{},C,1,1,1,1,1", bars.timestamp[0])), "instrument C has 1 bars"),
        ];
        for (name, edit, want) in cases {
            let path = write(name, edit);
            let e = Panel::from_long_csv(&path).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{name}: {e}");
        }
        let e = Panel::from_long_csv(&fixture("features_small.csv")).unwrap_err().to_string();
        assert!(e.contains("no symbol column"), "{e}");
    }

    /// Each instrument's normaliser is the single-instrument normaliser of its own rows inside
    /// the training span (bit for bit); values after the span and in masked cells change
    /// nothing; normalising leaves masked cells at 0; an instrument without a bar in the span
    /// is refused by name.
    #[test]
    fn normalisers_are_per_instrument_and_fitted_on_the_training_span_only() {
        let (full, gap) = full_and_gappy(100..140);
        let p = Panel::from_tables(vec![("a".into(), full.clone()), ("b".into(), gap.clone())]).unwrap();
        let (n_t, f) = (p.rows(), p.n_market());
        let train = 0..n_t / 2;
        let norms = p.fit_normalizers(train.clone()).unwrap();
        let end_ts = p.timestamp[train.end];
        for (norm, t) in norms.iter().zip([&full, &gap]) {
            let k = t.timestamp.iter().filter(|&&ts| ts < end_ts).count();
            assert_eq!(norm, &Normalizer::fit_rows(&t.market, f, 0..k).unwrap());
        }
        let mut later = p.clone();
        for c in train.end..n_t {
            for i in 0..2 {
                let cell = i * n_t + c;
                later.market[cell * f..(cell + 1) * f].iter_mut().for_each(|x| *x = 1e6);
            }
        }
        let masked: Vec<usize> = (0..n_t).map(|c| n_t + c).filter(|&cell| p.mask[cell] == 0).collect();
        assert!(!masked.is_empty());
        for &cell in &masked {
            later.market[cell * f..(cell + 1) * f].iter_mut().for_each(|x| *x = -1e6);
        }
        assert_eq!(later.fit_normalizers(train.clone()).unwrap(), norms, "values after the span or masked leaked");
        let mut normed = p.clone();
        normed.normalize(&norms).unwrap();
        assert!(masked.iter().all(|&cell| normed.market[cell * f..(cell + 1) * f].iter().all(|&x| x == 0.0)));
        let mut want = p.market[..f].to_vec();
        norms[0].apply_in_place(&mut want);
        assert_eq!(&normed.market[..f], &want[..]);
        let e = p.fit_normalizers(masked[0] - n_t..masked[0] - n_t + 1).unwrap_err().to_string();
        assert!(e.contains("instrument b has no bar"), "{e}");
        assert!(p.fit_normalizers(0..n_t + 1).is_err() && normed.normalize(&norms[..1]).is_err());
    }

    #[test]
    fn bad_panel_inputs_are_one_line_errors() {
        let dir = tempfile::tempdir().unwrap();
        let e = Panel::from_csv_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("holds no .csv or .parquet bar files"), "{e}");
        std::fs::copy(fixture("features_small.csv"), dir.path().join("a.csv")).unwrap();
        std::fs::write(dir.path().join("b.csv"), "timestamp,open,high,low,close,volume\n1,1,1,1,x,1\n").unwrap();
        let e = Panel::from_csv_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("b.csv:2") && !e.contains('\n'), "{e}");
        // Two files of one instrument (a.csv and a.parquet) are refused, naming the second.
        std::fs::write(dir.path().join("a.parquet"), "x").unwrap();
        std::fs::remove_file(dir.path().join("b.csv")).unwrap();
        let e = Panel::from_csv_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("a.parquet") && e.contains("a second bar file of instrument `a`"), "{e}");
        std::fs::remove_file(dir.path().join("a.parquet")).unwrap();
        let not_panel = dir.path().join("f.safetensors");
        crate::build_feature_file(&fixture("features_small.csv"), &not_panel).unwrap();
        let e = Panel::read(&not_panel).unwrap_err().to_string();
        assert!(e.contains("metadata lacks `instruments`") || e.contains("schema is"), "{e}");
    }
}
