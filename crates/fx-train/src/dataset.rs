//! The run's data: features from a file, from bars, or from the synthetic market; the
//! chronological split; the normaliser fitted on the training rows; and the
//! environment series built from them.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use fx_data::{FeatureStore, Normalizer, Splits};
use fx_kernels::{EnvData, N_MARKET};

use crate::config::RunConfig;

/// Features, split and normaliser of a run.
pub struct Dataset {
    pub store: FeatureStore,
    pub splits: Splits,
    pub normalizer: Normalizer,
    /// Where the rows came from (file name or `synthetic(seed=…)`).
    pub source: String,
    pub periods_per_year: f64,
}

impl Dataset {
    /// Loads the data a config names and fits the normaliser on its training rows. A saved
    /// normaliser (from a checkpoint) replaces the fitted one, so a resumed or evaluated
    /// run sees exactly the inputs it was trained on.
    pub fn load(cfg: &RunConfig, saved: Option<Normalizer>) -> Result<Self> {
        let (store, source) = match &cfg.data {
            None => {
                let table = fx_data::synthetic::feature_table(&cfg.synthetic)?;
                let source = format!("synthetic(seed={}, bars={})", cfg.synthetic.seed, cfg.synthetic.bars);
                (FeatureStore::from_table(table)?, source)
            }
            Some(path) => (open_features(path)?, path.display().to_string()),
        };
        if store.n_market() != N_MARKET {
            bail!("{source}: {} market features per row, the models need {N_MARKET}", store.n_market());
        }
        // The count is not the schema: a renamed or reordered column feeds a model the wrong input.
        let spec = fx_data::features::MARKET_FEATURE_NAMES;
        if let Some((i, (got, want))) =
            store.feature_names().iter().zip(spec).enumerate().find(|(_, (g, w))| g.as_str() != *w)
        {
            bail!("{source}: market feature {i} is {got:?} where DATA.md has {want:?} (renamed or reordered columns)");
        }
        let splits = match &cfg.rows {
            Some(r) => check_rows(r, store.rows()).with_context(|| format!("the run's rows of {source}"))?,
            None => cfg.split.split(store.rows()).with_context(|| format!("splitting {source}"))?,
        };
        let min_rows = cfg.env.episode_len + 1;
        // Sequence models check their windows against the splits themselves.
        if !cfg.model.is_sequence() && splits.train.len() < min_rows {
            bail!(
                "{source}: the training split has {} rows, an episode of {} steps needs at least {min_rows} \
                 (use more data or a shorter env.episode_len)",
                splits.train.len(),
                cfg.env.episode_len
            );
        }
        if splits.test.len() < 2 {
            bail!("{source}: the test split has {} rows, a backtest needs at least 2", splits.test.len());
        }
        let normalizer = match saved {
            Some(n) => {
                if n.width() != store.n_market() {
                    bail!(
                        "{source}: the checkpoint's normaliser has {} features, the data {}",
                        n.width(),
                        store.n_market()
                    );
                }
                n
            }
            None => Normalizer::fit(&store, splits.train.clone())?,
        };
        let periods_per_year = cfg.periods_per_year.unwrap_or_else(|| infer_periods_per_year(store.timestamps()));
        Ok(Dataset { store, splits, normalizer, source, periods_per_year })
    }

    /// The environment series over `rows`: normalised market features and close prices.
    pub fn env_data(&self, rows: std::ops::Range<usize>) -> Result<Arc<EnvData>> {
        let mut market = self.store.market_rows(rows.clone()).to_vec();
        self.normalizer.apply_in_place(&mut market);
        let close = self.store.close()[rows].to_vec();
        Ok(Arc::new(EnvData::new(market, close)?))
    }
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

fn open_features(path: &Path) -> Result<FeatureStore> {
    if path.is_dir() {
        bail!(
            "{} is a folder: a folder of bar files is a panel, which `fx-train features --input {}` writes; \
             training on panels is not built yet",
            path.display(),
            path.display()
        );
    }
    // A symlink (loop or dangling) exists as a link though `exists()` is false: the opener
    // names what it is.
    if !path.exists() && std::fs::symlink_metadata(path).is_err() {
        bail!("data file {} does not exist", path.display());
    }
    let is_csv = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv"));
    if is_csv {
        Ok(FeatureStore::from_table(fx_data::FeatureTable::from_csv(path)?)?)
    } else {
        Ok(FeatureStore::open(path)?)
    }
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
}
