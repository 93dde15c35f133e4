//! `GpuSeries`: the device copy of an env's series, uploaded once and shared by every
//! [`GpuTradingEnv`] built from it, in two parts:
//! - the rows (market features and closes of an `Arc<SeriesRows>`), one copy per rows and
//!   device, whatever number of [`EnvData`] views index them: a walk-forward study's folds
//!   are views of the same rows, each with its own segments and normalisers;
//! - a view's segment bounds and per-segment normalisers (a few hundred bytes an
//!   instrument), one copy per `Arc<EnvData>` and device.
//!
//! The kernels only read the series, so the members of a population (a sweep's trials, a
//! study's folds and seeds) need one copy between them, not one each. The rows are
//! `R · (51·4 + 8)` bytes: a panel of 500 instruments × 5,000 days is 0.5 GiB, which N
//! members or K folds would otherwise hold N or K times (a default DQN run's replay is
//! 64,000 × 460 B ≈ 29 MB).
//!
//! [`GpuTradingEnv`]: super::GpuTradingEnv

use std::sync::{Arc, Mutex, Weak};

use candle_core::Device;
use cudarc::driver::{CudaSlice, CudaStream};

use super::driver;
use super::gpu_env::raw;
use crate::env::{EnvData, SeriesRows};
use crate::error::Result;

/// One device copy of a [`SeriesRows`].
struct GpuRows {
    // Owned for the addresses below, which the kernels read.
    _market: CudaSlice<f32>,
    _close: CudaSlice<f64>,
    device: Device,
    market: u64,
    close: u64,
}

/// One device copy of a series: its rows (shared) and its view's segments and normalisers;
/// freed when the last env holding it is dropped.
pub(crate) struct GpuSeries {
    _rows: Arc<GpuRows>,
    _seg: CudaSlice<u32>,
    _norm: Option<CudaSlice<f32>>,
    /// The device the copy lives on (the cache's key, with the data).
    device: Device,
    /// Address of the `[T, N_MARKET]` raw market rows.
    pub(crate) market: u64,
    /// Address of the `[T]` closes.
    pub(crate) close: u64,
    /// Address of the `[2S]` segment bounds: start, end of segment k at `2k`, `2k + 1`.
    pub(crate) seg: u64,
    /// Address of the `[S, 2, N_MARKET]` normalisers (means, then stds), 0 for none.
    pub(crate) norm: u64,
    /// The normalisers' clip bound (0 without normalisers).
    pub(crate) clip: f32,
}

trait OnDevice {
    fn device(&self) -> &Device;
}

impl OnDevice for GpuRows {
    fn device(&self) -> &Device {
        &self.device
    }
}

impl OnDevice for GpuSeries {
    fn device(&self) -> &Device {
        &self.device
    }
}

/// Live copies keyed by the host data they hold. A `Weak` keeps its allocation, so an
/// address equal to a live `Arc`'s is that same data (never a later one at a reused
/// address); entries whose copy is gone are dropped on the next lookup.
type Live<K, V> = Mutex<Vec<(Weak<K>, Weak<V>)>>;

static ROWS: Live<SeriesRows, GpuRows> = Mutex::new(Vec::new());
static VIEWS: Live<EnvData, GpuSeries> = Mutex::new(Vec::new());

/// The live copy of `key` on `device`, else `make()`'s, recorded.
fn shared<K, V: OnDevice>(
    live: &Live<K, V>,
    key: &Arc<K>,
    device: &Device,
    make: impl FnOnce() -> Result<V>,
) -> Result<Arc<V>> {
    // A panic elsewhere while holding the lock leaves the list consistent (pushes and
    // retains only), so a poisoned lock is taken as is.
    let mut live = live.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|(_, v)| v.strong_count() > 0);
    let found = live
        .iter()
        .filter(|(k, _)| Weak::as_ptr(k) == Arc::as_ptr(key))
        .filter_map(|(_, v)| v.upgrade())
        .find(|v| v.device().same_device(device));
    if let Some(v) = found {
        return Ok(v);
    }
    let v = Arc::new(make()?);
    live.push((Arc::downgrade(key), Arc::downgrade(&v)));
    Ok(v)
}

impl GpuSeries {
    /// The device copy of `data` on `device` (whose stream is `stream`): the live one if an
    /// env already holds it, else a new upload of its segments and normalisers over the
    /// live copy of its rows (uploaded if no env holds those either).
    pub(crate) fn of(data: &Arc<EnvData>, device: &Device, stream: &Arc<CudaStream>) -> Result<Arc<Self>> {
        let up = "GpuTradingEnv::new (series upload)";
        shared(&VIEWS, data, device, || {
            let rows = shared(&ROWS, data.rows(), device, || {
                let market = stream.clone_htod(data.rows().market()).map_err(driver(up))?;
                let close = stream.clone_htod(data.rows().close()).map_err(driver(up))?;
                Ok(GpuRows {
                    market: raw(&market, stream),
                    close: raw(&close, stream),
                    _market: market,
                    _close: close,
                    device: device.clone(),
                })
            })?;
            // Bounds below 2^32: the env checks the series length.
            let bounds: Vec<u32> = data.segments().iter().flat_map(|r| [r.start as u32, r.end as u32]).collect();
            let seg = stream.clone_htod(&bounds).map_err(driver(up))?;
            let norm = match data.norms() {
                Some(n) => Some(stream.clone_htod(n.table()).map_err(driver(up))?),
                None => None,
            };
            Ok(Self {
                market: rows.market,
                close: rows.close,
                seg: raw(&seg, stream),
                norm: norm.as_ref().map_or(0, |n| raw(n, stream)),
                clip: data.norms().map_or(0.0, |n| n.clip()),
                _rows: rows,
                _seg: seg,
                _norm: norm,
                device: device.clone(),
            })
        })
    }
}
