//! The run's data: one instrument's features (from a feature file, from bars, or from the
//! synthetic market) or a panel of instruments on one calendar (a folder of bar files, a
//! long-format CSV or a panel file, see `fx_data::panel`); the chronological split of the
//! calendar; one normaliser per instrument fitted on its own training rows; and the
//! environment series built from them.
//!
//! Spans are calendar rows, so every instrument's training rows end where the split says,
//! and no instrument's training data reaches into another's validation or test time. One
//! instrument's calendar is its own rows, so a single-instrument run is what it always was.
//! An instrument of a panel with fewer than two rows in the training span has no
//! normaliser that would not peek at later data: it is left out of the run (and named).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use fx_data::{FeatureStore, Normalizer, Panel, Splits};
use fx_kernels::{EnvData, SeriesRows, N_MARKET};

use crate::config::RunConfig;

/// One instrument of the run's data.
pub struct Instrument {
    pub name: String,
    /// Its place in the source's instruments (a fold may leave some out).
    pub position: usize,
    /// Its own feature rows, in time order (shared by the datasets of one [`Source`]).
    pub store: Arc<FeatureStore>,
    /// The calendar row of each of its rows (strictly increasing).
    pub calendar_rows: Vec<usize>,
    /// Fitted on its rows inside the training span.
    pub normalizer: Normalizer,
}

/// Features, split and normalisers of a run.
pub struct Dataset {
    pub instruments: Vec<Instrument>,
    /// Timestamps of the calendar rows (one instrument: its own rows').
    pub calendar: Vec<i64>,
    /// The spans, in calendar rows.
    pub splits: Splits,
    /// Where the rows came from (file or folder name, or `synthetic(seed=…)`).
    pub source: String,
    pub periods_per_year: f64,
    /// Panel instruments left out: too few rows in the training span.
    pub excluded: Vec<String>,
    /// The opened data (kept so that datasets loaded meanwhile share it).
    _source: Arc<Source>,
}

/// An instrument's part of a span: its environment series and the span's index of the
/// calendar row each of its steps starts at.
pub struct InstrumentSpan {
    pub instrument: usize,
    pub series: Arc<EnvData>,
    pub steps: Vec<usize>,
}

/// The data a config names, opened once (read and checked, features computed from bars):
/// each instrument's feature store, its calendar rows, the calendar and the source's name.
/// The datasets of a study's folds are made from one `Source` ([`Dataset::of_source`]), so
/// the data is read once and every fold's dataset shares its features; [`Source::open`]
/// hands out the one a live dataset holds.
pub struct Source {
    tables: Vec<(String, Arc<FeatureStore>, Vec<usize>)>,
    calendar: Vec<i64>,
    source: String,
}

/// The sources some dataset still holds, by what they were opened from.
static OPEN: std::sync::Mutex<Vec<(String, std::sync::Weak<Source>)>> = std::sync::Mutex::new(Vec::new());

impl Source {
    /// The source `cfg` names: the one a live dataset of this process already holds (a
    /// study holds its source while its runs train, so they read the data once between
    /// them), else [`Self::read`]'s.
    pub fn open(cfg: &RunConfig) -> Result<Arc<Self>> {
        let key = match &cfg.data {
            Some(p) => format!("data {}", p.canonicalize().unwrap_or_else(|_| p.clone()).display()),
            None => format!("synthetic {:?}", cfg.synthetic),
        };
        // A panic elsewhere while holding the lock leaves the list consistent (pushes and
        // retains only), so a poisoned lock is taken as is.
        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, s)| s.strong_count() > 0);
        if let Some(s) = open.iter().filter(|(k, _)| *k == key).find_map(|(_, s)| s.upgrade()) {
            return Ok(s);
        }
        let s = Arc::new(Self::read(cfg)?);
        open.push((key, Arc::downgrade(&s)));
        Ok(s)
    }

    /// Reads `cfg.data` (or makes the synthetic market) and checks its feature schema.
    pub fn read(cfg: &RunConfig) -> Result<Self> {
        let (tables, calendar, source) = match &cfg.data {
            None => {
                let table = fx_data::synthetic::feature_table(&cfg.synthetic)?;
                let source = format!("synthetic(seed={}, bars={})", cfg.synthetic.seed, cfg.synthetic.bars);
                let store = FeatureStore::from_table(table)?;
                let calendar = store.timestamps().to_vec();
                (vec![("synthetic".to_string(), store, (0..calendar.len()).collect())], calendar, source)
            }
            Some(path) => open_data(path)?,
        };
        let panel = tables.len() > 1;
        for (name, store, _) in &tables {
            let what = if panel { format!("{source} ({name})") } else { source.clone() };
            check_schema(store, &what)?;
        }
        let tables = tables.into_iter().map(|(n, s, r)| (n, Arc::new(s), r)).collect();
        Ok(Self { tables, calendar, source })
    }
}

impl Dataset {
    /// Loads the data a config names and fits the normalisers on the training rows. Saved
    /// normalisers (from a checkpoint) replace the fitted ones, so a resumed or evaluated
    /// run sees exactly the inputs it was trained on.
    pub fn load(cfg: &RunConfig, saved: Option<Vec<Normalizer>>) -> Result<Self> {
        Self::of_source(cfg, &Source::open(cfg)?, saved)
    }

    /// [`Self::load`] over an opened [`Source`] (the one `cfg` names): the spans and
    /// normalisers of `cfg` without reading the data again, the features shared.
    pub fn of_source(cfg: &RunConfig, src: &Arc<Source>, saved: Option<Vec<Normalizer>>) -> Result<Self> {
        let (tables, calendar, source) = (&src.tables, &src.calendar, &src.source);
        let panel = tables.len() > 1;
        let rows = calendar.len();
        let splits = match &cfg.rows {
            Some(r) => check_rows(r, rows).with_context(|| format!("the run's rows of {source}"))?,
            None => cfg.split.split(rows).with_context(|| format!("splitting {source}"))?,
        };
        let mut instruments = Vec::with_capacity(tables.len());
        let mut excluded = Vec::new();
        for (position, (name, store, calendar_rows)) in tables.iter().enumerate() {
            let own = own_rows(calendar_rows, &splits.train);
            if panel && own.len() < 2 {
                excluded.push(name.clone());
                continue;
            }
            let normalizer = Normalizer::fit(store, own).with_context(|| format!("normalising {source}"))?;
            let (name, store, calendar_rows) = (name.clone(), store.clone(), calendar_rows.clone());
            instruments.push(Instrument { name, position, store, calendar_rows, normalizer });
        }
        if instruments.is_empty() {
            bail!("{source}: no instrument has two rows in the training span {:?}", splits.train);
        }
        if let Some(saved) = saved {
            if saved.len() != instruments.len() {
                bail!(
                    "{source}: the checkpoint has {} normalisers, the data {} instruments",
                    saved.len(),
                    instruments.len()
                );
            }
            for (inst, n) in instruments.iter_mut().zip(saved) {
                if n.width() != inst.store.n_market() {
                    bail!(
                        "{source}: the checkpoint's normaliser has {} features, the data {}",
                        n.width(),
                        inst.store.n_market()
                    );
                }
                inst.normalizer = n;
            }
        }
        // Each instrument's own bar spacing (the panel's calendar spans every instrument's
        // dates: instruments listed one after another would look sparse), the median of them.
        let periods_per_year = cfg.periods_per_year.unwrap_or_else(|| {
            let own: Vec<&[i64]> = instruments.iter().map(|i| i.store.timestamps()).collect();
            median_periods_per_year(&own).unwrap_or_else(|| infer_periods_per_year(calendar))
        });
        let (calendar, source) = (calendar.clone(), source.clone());
        let data = Dataset { instruments, calendar, splits, source, periods_per_year, excluded, _source: src.clone() };
        // Sequence models check their windows against the splits themselves.
        let min_rows = cfg.env.episode_len + 1;
        if !cfg.model.is_sequence() && data.longest_in(&data.splits.train) < min_rows {
            let what = if panel { "every instrument's part of the training split" } else { "the training split" };
            bail!(
                "{}: {what} has at most {} rows, an episode of {} steps needs at least {min_rows} \
                 (use more data or a shorter env.episode_len)",
                data.source,
                data.longest_in(&data.splits.train),
                cfg.env.episode_len
            );
        }
        if data.longest_in(&data.splits.test) < 2 {
            bail!("{}: the test split has {} rows, a backtest needs at least 2", data.source, data.splits.test.len());
        }
        Ok(data)
    }

    /// Calendar rows.
    pub fn rows(&self) -> usize {
        self.calendar.len()
    }

    /// More than one instrument.
    pub fn is_panel(&self) -> bool {
        self.instruments.len() > 1
    }

    /// The normalisers, in instrument order (what a checkpoint keeps).
    pub fn normalizers(&self) -> Vec<Normalizer> {
        self.instruments.iter().map(|i| i.normalizer.clone()).collect()
    }

    /// The most rows any instrument has inside the calendar span.
    fn longest_in(&self, span: &Range<usize>) -> usize {
        self.instruments.iter().map(|i| own_rows(&i.calendar_rows, span).len()).max().unwrap_or(0)
    }

    /// Instrument `i`'s part of the calendar span `span` (at least 2 rows, else `None`):
    /// normalised market features and close prices, and the span index of each step.
    pub fn instrument_span(&self, i: usize, span: &Range<usize>) -> Result<Option<InstrumentSpan>> {
        let inst = &self.instruments[i];
        let own = own_rows(&inst.calendar_rows, span);
        if own.len() < 2 {
            return Ok(None);
        }
        let (market, close) = inst.series(own.clone());
        let series =
            Arc::new(EnvData::new(market, close).with_context(|| format!("{} of {}", inst.name, self.source))?);
        let steps = inst.calendar_rows[own.start..own.end - 1].iter().map(|&c| c - span.start).collect();
        Ok(Some(InstrumentSpan { instrument: i, series, steps }))
    }

    /// Every instrument's part of `span` that has at least 2 rows.
    pub fn spans(&self, span: &Range<usize>) -> Result<Vec<InstrumentSpan>> {
        Ok((0..self.instruments.len())
            .map(|i| self.instrument_span(i, span))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect())
    }

    /// The environment series over the calendar span `rows`: each instrument's rows there
    /// with at least `min_rows` of them (an episode's length plus one), one segment each
    /// (one instrument: exactly its rows, as before panels).
    pub fn env_data(&self, rows: Range<usize>, min_rows: usize) -> Result<Arc<EnvData>> {
        let (mut market, mut close, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for inst in &self.instruments {
            let own = own_rows(&inst.calendar_rows, &rows);
            if own.len() < min_rows.max(2) {
                continue;
            }
            let (m, c) = inst.series(own.clone());
            market.extend(m);
            close.extend(c);
            lens.push(own.len());
        }
        if lens.is_empty() {
            bail!("{}: no instrument has {} rows in calendar rows {rows:?}", self.source, min_rows.max(2));
        }
        Ok(Arc::new(EnvData::from_segments(market, close, &lens).with_context(|| self.source.clone())?))
    }
}

/// The raw rows of every instrument of several datasets of one source (a walk-forward
/// study's folds) inside the span their training spans cover, each instrument once, for
/// [`Dataset::env_view`]: the folds' training series are views of these rows, so a GPU
/// holds the data once for all folds (and one fold's rows are exactly what its own copy
/// held).
pub struct SharedRows {
    pub rows: Arc<SeriesRows>,
    /// By instrument name: its first row in `rows` and the own rows held there.
    starts: std::collections::HashMap<String, (usize, Range<usize>)>,
}

impl SharedRows {
    /// The instruments of `datasets` (by name: an instrument one fold leaves out may be in
    /// another), in the source's order (so every fold's segments lie in order, as its own
    /// copy's do), each with its own rows over the span from the earliest training start to
    /// the latest training end (calendar rows).
    pub fn of(datasets: &[&Dataset]) -> Result<Self> {
        let span = datasets.iter().map(|d| d.splits.train.start).min().unwrap_or(0)
            ..datasets.iter().map(|d| d.splits.train.end).max().unwrap_or(0);
        let mut all: Vec<&Instrument> = datasets.iter().flat_map(|d| &d.instruments).collect();
        all.sort_by_key(|i| i.position);
        all.dedup_by(|a, b| a.name == b.name);
        let (mut market, mut close) = (Vec::new(), Vec::new());
        let mut starts = std::collections::HashMap::new();
        for inst in all {
            let own = own_rows(&inst.calendar_rows, &span);
            starts.insert(inst.name.clone(), (close.len(), own.clone()));
            market.extend_from_slice(inst.store.market_rows(own.clone()));
            close.extend_from_slice(&inst.store.close()[own]);
        }
        let source = datasets.first().map_or("", |d| d.source.as_str());
        let rows = SeriesRows::new(market, close).with_context(|| format!("the training rows of {source}"))?;
        Ok(Self { rows: Arc::new(rows), starts })
    }
}

impl Dataset {
    /// [`Self::env_data`] as a view of `shared` (which holds this dataset's instruments): the
    /// same segments, observed through this dataset's normalisers, without a copy of the
    /// rows.
    pub fn env_view(&self, shared: &SharedRows, rows: Range<usize>, min_rows: usize) -> Result<Arc<EnvData>> {
        let (mut segments, mut norms) = (Vec::new(), Vec::new());
        for inst in &self.instruments {
            let own = own_rows(&inst.calendar_rows, &rows);
            if own.len() < min_rows.max(2) {
                continue;
            }
            let Some((start, held)) = shared.starts.get(&inst.name) else {
                bail!("{}: instrument {} is not in the shared rows", self.source, inst.name);
            };
            if own.start < held.start || own.end > held.end {
                bail!(
                    "{}: instrument {}'s rows {own:?} are not within the shared rows {held:?}",
                    self.source,
                    inst.name
                );
            }
            segments.push(start + own.start - held.start..start + own.end - held.start);
            norms.push(inst.normalizer.clone());
        }
        if segments.is_empty() {
            bail!("{}: no instrument has {} rows in calendar rows {rows:?}", self.source, min_rows.max(2));
        }
        Ok(Arc::new(EnvData::view(shared.rows.clone(), segments, &norms).with_context(|| self.source.clone())?))
    }
}

impl Instrument {
    /// Normalised market features and close prices of its own rows `own`.
    fn series(&self, own: Range<usize>) -> (Vec<f32>, Vec<f64>) {
        let mut market = self.store.market_rows(own.clone()).to_vec();
        self.normalizer.apply_in_place(&mut market);
        (market, self.store.close()[own].to_vec())
    }
}

/// The instrument's own rows whose calendar rows lie in `span` (contiguous: its calendar
/// rows increase).
pub(crate) fn own_rows(calendar_rows: &[usize], span: &Range<usize>) -> Range<usize> {
    calendar_rows.partition_point(|&c| c < span.start)..calendar_rows.partition_point(|&c| c < span.end)
}

/// The count is not the schema: a renamed or reordered column feeds a model the wrong input.
fn check_schema(store: &FeatureStore, source: &str) -> Result<()> {
    if store.n_market() != N_MARKET {
        bail!("{source}: {} market features per row, the models need {N_MARKET}", store.n_market());
    }
    let spec = fx_data::features::MARKET_FEATURE_NAMES;
    if let Some((i, (got, want))) =
        store.feature_names().iter().zip(spec).enumerate().find(|(_, (g, w))| g.as_str() != *w)
    {
        bail!("{source}: market feature {i} is {got:?} where DATA.md has {want:?} (renamed or reordered columns)");
    }
    Ok(())
}

/// Explicit spans (a walk-forward fold's): non-empty, in time order, inside the table.
fn check_rows(r: &Splits, rows: usize) -> Result<Splits> {
    let spans = [("train", &r.train), ("valid", &r.valid), ("test", &r.test)];
    for (name, s) in spans {
        if s.is_empty() || s.end > rows {
            bail!("{name} rows {}..{} must be non-empty and within the {rows} rows", s.start, s.end);
        }
    }
    if r.train.end > r.valid.start || r.valid.end > r.test.start {
        bail!("spans {:?}, {:?}, {:?} must be in time order (train, valid, test)", r.train, r.valid, r.test);
    }
    Ok(r.clone())
}

/// Instruments (name, features, calendar rows), the calendar and the source's name.
type Opened = (Vec<(String, FeatureStore, Vec<usize>)>, Vec<i64>, String);

fn open_data(path: &Path) -> Result<Opened> {
    let source = path.display().to_string();
    // A symlink (loop or dangling) exists as a link though `exists()` is false: the opener
    // names what it is.
    if !path.exists() && std::fs::symlink_metadata(path).is_err() {
        bail!("data file {source} does not exist");
    }
    // A panel file is mapped, its instruments views of the map where their rows allow.
    if path.is_file() && fx_data::panel::is_panel_file(path)? {
        let pf = fx_data::PanelFile::open(path)?;
        let mut out = Vec::with_capacity(pf.instruments().len());
        for (i, name) in pf.instruments().iter().enumerate() {
            let (store, rows) = pf.instrument(i)?;
            out.push((name.clone(), store, rows));
        }
        return Ok((out, pf.timestamps().into_owned(), source));
    }
    if let Some(panel) = Panel::load(path)? {
        let mut out = Vec::with_capacity(panel.instruments.len());
        for i in 0..panel.instruments.len() {
            let (table, rows) = panel.instrument(i)?;
            out.push((panel.instruments[i].clone(), FeatureStore::from_table(table)?, rows));
        }
        return Ok((out, panel.timestamp, source));
    }
    let is_bars = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) || fx_data::bars::is_parquet(path);
    let store = if is_bars {
        FeatureStore::from_table(fx_data::FeatureTable::from_bar_file(path)?)?
    } else {
        FeatureStore::open(path)?
    };
    let calendar = store.timestamps().to_vec();
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Ok((vec![(name, store, (0..calendar.len()).collect())], calendar, source))
}

/// Bars per year of a panel: the median over its instruments of each one's own
/// [`infer_periods_per_year`] (None without instruments).
fn median_periods_per_year(instruments: &[&[i64]]) -> Option<f64> {
    let mut per: Vec<f64> = instruments.iter().map(|ts| infer_periods_per_year(ts)).collect();
    per.sort_by(f64::total_cmp);
    per.get(per.len() / 2).copied()
}

/// Bars per year from the timestamps: rows over elapsed years (252-ish for daily equity
/// bars, 8,766 for round-the-clock hourly bars).
pub fn infer_periods_per_year(ts: &[i64]) -> f64 {
    const YEAR_S: f64 = 365.25 * 86_400.0;
    match (ts.first(), ts.last()) {
        (Some(&a), Some(&b)) if b > a && ts.len() > 1 => (ts.len() - 1) as f64 / ((b - a) as f64 / YEAR_S),
        _ => 252.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_per_year_from_spacing() {
        let hourly: Vec<i64> = (0..1000).map(|i| i * 3600).collect();
        assert!((infer_periods_per_year(&hourly) - 8766.0).abs() < 1.0);
        // Weekdays only, daily.
        let days: Vec<i64> = (0..3000i64).filter(|d| (d + 3) % 7 < 5).map(|d| d * 86_400).collect();
        assert!((infer_periods_per_year(&days) - 261.0).abs() < 1.5);
    }

    /// Instruments listed one after another (daily bars, 2000–2003 and 2008–2011): the
    /// union calendar looks sparse over 12 years, each instrument's own spacing does not.
    #[test]
    fn a_panel_of_instruments_one_after_another_keeps_its_bar_rate() {
        let day = 86_400i64;
        let a: Vec<i64> = (0..1461).map(|d| d * day).collect();
        let b: Vec<i64> = (2922..4383).map(|d| d * day).collect();
        let union: Vec<i64> = a.iter().chain(&b).copied().collect();
        assert!(infer_periods_per_year(&union) < 250.0);
        let ppy = median_periods_per_year(&[&a, &b]).unwrap();
        assert!((ppy - 365.25).abs() < 1.0, "{ppy}");
        assert_eq!(median_periods_per_year(&[]), None);
    }

    /// Two synthetic instruments on one calendar (the second starts later and skips every
    /// seventh day), split with training rows `0..train`.
    fn two_instruments(train: usize, seed: u64) -> Dataset {
        let mut instruments = Vec::new();
        for (k, rows) in
            [(0..600).collect::<Vec<usize>>(), (80..600).filter(|r| r % 7 != 3).collect()].into_iter().enumerate()
        {
            let cfg = fx_data::synthetic::SyntheticConfig {
                seed: seed + k as u64,
                bars: rows.len() + 80,
                ..Default::default()
            };
            let store = Arc::new(FeatureStore::from_table(fx_data::synthetic::feature_table(&cfg).unwrap()).unwrap());
            let store_rows = store.rows();
            let calendar_rows: Vec<usize> = rows.into_iter().take(store_rows).collect();
            let own = own_rows(&calendar_rows, &(0..train));
            let normalizer = Normalizer::fit(&store, own).unwrap();
            instruments.push(Instrument { name: format!("i{k}"), position: k, store, calendar_rows, normalizer });
        }
        let splits = Splits { train: 0..train, valid: train..train + 50, test: train + 50..600 };
        Dataset {
            instruments,
            calendar: (0..600).collect(),
            splits,
            source: "test".into(),
            periods_per_year: 252.0,
            excluded: Vec::new(),
            _source: Arc::new(Source { tables: Vec::new(), calendar: Vec::new(), source: "test".into() }),
        }
    }

    /// Two folds' training series as views of one copy of the rows observe what their own
    /// normalised copies hold, bit for bit, row by row, and share that copy; a span beyond
    /// the shared rows is refused.
    #[test]
    fn fold_views_observe_their_normalised_copies() {
        let seed = fx_hw::test_seed("fold_views_observe_their_normalised_copies");
        let mut folds = [two_instruments(250, seed), two_instruments(400, seed)];
        // The first fold leaves out the source's first instrument (as a fold without two of
        // its rows in the training span does): the later fold's segments still lie in order.
        folds[0].instruments.remove(0);
        let shared = SharedRows::of(&folds.iter().collect::<Vec<_>>()).unwrap();
        let mut views = Vec::new();
        for d in &folds {
            let copy = d.env_data(d.splits.train.clone(), 30).unwrap();
            let view = d.env_view(&shared, d.splits.train.clone(), 30).unwrap();
            let lens = |e: &EnvData| e.segments().iter().map(|s| s.len()).collect::<Vec<_>>();
            assert_eq!(lens(&copy), lens(&view));
            let (mut a, mut b) = ([0f32; N_MARKET], [0f32; N_MARKET]);
            for (sc, sv) in copy.segments().iter().zip(view.segments()) {
                for (tc, tv) in sc.clone().zip(sv.clone()) {
                    copy.market_row(tc, &mut a);
                    view.market_row(tv, &mut b);
                    assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "seed {seed}: rows {tc} / {tv}");
                    assert_eq!(copy.close()[tc].to_bits(), view.close()[tv].to_bits());
                }
            }
            views.push(view);
        }
        assert!(Arc::ptr_eq(views[0].rows(), views[1].rows()), "one copy of the rows for both folds");
        // The rows of the longer training span, once (what its own copy held).
        assert_eq!(shared.rows.len(), folds[1].env_data(folds[1].splits.train.clone(), 30).unwrap().len());
        // A dataset with an instrument the shared rows lack is refused in one line.
        let e = folds[1].env_view(&shared, 0..500, 30).err().map(|e| format!("{e:#}"));
        assert!(e.as_deref().is_some_and(|e| e.contains("not within the shared rows")), "{e:?}");
        let mut other = two_instruments(250, seed);
        other.instruments[1].name = "i9".into();
        let e = other.env_view(&shared, other.splits.train.clone(), 30).err().map(|e| format!("{e:#}"));
        assert!(e.as_deref().is_some_and(|e| e.contains("instrument i9 is not in the shared rows")), "{e:?}");
    }

    /// Two folds' datasets of one opened source share its features (no second read, no
    /// copy) and fit their own normalisers on their own training spans.
    #[test]
    fn folds_of_one_source_share_its_features() {
        let cfg = RunConfig::default();
        let src = Source::open(&cfg).unwrap();
        let n = src.calendar.len();
        let fold = |train_end: usize| RunConfig {
            rows: Some(Splits { train: 0..train_end, valid: train_end..train_end + 50, test: train_end + 50..n }),
            ..cfg.clone()
        };
        let (a, b) = (
            Dataset::of_source(&fold(n / 3), &src, None).unwrap(),
            Dataset::of_source(&fold(n / 2), &src, None).unwrap(),
        );
        assert!(Arc::ptr_eq(&a.instruments[0].store, &b.instruments[0].store));
        assert!(Arc::ptr_eq(&a.instruments[0].store, &src.tables[0].1));
        assert_ne!(a.instruments[0].normalizer, b.instruments[0].normalizer);
        // A dataset loaded while the source is held shares it, and is what it would be alone.
        let alone = Dataset::load(&fold(n / 2), None).unwrap();
        assert!(Arc::ptr_eq(&alone.instruments[0].store, &src.tables[0].1));
        assert_eq!(alone.instruments[0].normalizer, b.instruments[0].normalizer);
        assert_eq!(alone.splits, b.splits);
        drop((a, b, alone, src));
        let again = Source::open(&cfg).unwrap();
        let other = RunConfig {
            synthetic: fx_data::synthetic::SyntheticConfig { seed: 99, ..cfg.synthetic.clone() },
            ..cfg.clone()
        };
        assert!(!Arc::ptr_eq(&Source::open(&other).unwrap(), &again), "another source is opened on its own");
    }

    #[test]
    fn own_rows_are_the_calendar_span() {
        let cal = [0, 2, 3, 7, 9];
        assert_eq!(own_rows(&cal, &(0..3)), 0..2);
        assert_eq!(own_rows(&cal, &(3..8)), 2..4);
        assert_eq!(own_rows(&cal, &(4..7)), 3..3);
        assert_eq!(own_rows(&cal, &(8..20)), 4..5);
    }
}
