//! `GpuSeries`: the device copy of an env's series (market rows, closes, segment bounds),
//! uploaded once per `Arc<EnvData>` and device and shared by every [`GpuTradingEnv`]
//! built from them.
//!
//! The kernels only read the series, so the members of a population (a sweep's trials, a
//! study's seeds of one fold) need one copy between them, not one each. A series is
//! `T · (51·4 + 8)` bytes (market rows and closes): a panel of 500 instruments × 5,000
//! days is 0.5 GiB, which N members would hold N times (a default DQN run's replay is
//! 64,000 × 460 B ≈ 29 MB).
//!
//! [`GpuTradingEnv`]: super::GpuTradingEnv

use std::sync::{Arc, Mutex, Weak};

use candle_core::Device;
use cudarc::driver::{CudaSlice, CudaStream};

use super::driver;
use super::gpu_env::raw;
use crate::env::EnvData;
use crate::error::Result;

/// One device copy of a series; freed when the last env holding it is dropped.
pub(crate) struct GpuSeries {
    // Owned for the addresses below, which the kernels read.
    _market: CudaSlice<f32>,
    _close: CudaSlice<f64>,
    _seg: CudaSlice<u32>,
    /// The device the copy lives on (the cache's key, with the data).
    device: Device,
    /// Address of the `[T, N_MARKET]` market rows.
    pub(crate) market: u64,
    /// Address of the `[T]` closes.
    pub(crate) close: u64,
    /// Address of the `[S + 1]` segment boundaries.
    pub(crate) seg: u64,
}

/// The live copies, keyed by the data they hold. A `Weak<EnvData>` keeps its allocation, so
/// an address equal to a live `Arc`'s is that same data (never a later one at a reused
/// address); entries whose copy is gone are dropped on the next lookup.
struct Entry {
    data: Weak<EnvData>,
    series: Weak<GpuSeries>,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

impl GpuSeries {
    /// The device copy of `data` on `device` (whose stream is `stream`): the live one if an
    /// env already holds it, else a new upload.
    pub(crate) fn of(data: &Arc<EnvData>, device: &Device, stream: &Arc<CudaStream>) -> Result<Arc<Self>> {
        // A panic elsewhere while holding the lock leaves the list consistent (pushes and
        // retains only), so a poisoned lock is taken as is.
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|e| e.series.strong_count() > 0);
        let shared = live
            .iter()
            .filter(|e| Weak::as_ptr(&e.data) == Arc::as_ptr(data))
            .filter_map(|e| e.series.upgrade())
            .find(|s| s.device.same_device(device));
        if let Some(s) = shared {
            return Ok(s);
        }
        let up = "GpuTradingEnv::new (series upload)";
        let market = stream.clone_htod(data.market()).map_err(driver(up))?;
        let close = stream.clone_htod(data.close()).map_err(driver(up))?;
        // Segment boundaries `[S + 1]` (below 2^32: the env checks the series length).
        let bounds: Vec<u32> = data.segments().iter().map(|r| r.start as u32).chain([data.len() as u32]).collect();
        let seg = stream.clone_htod(&bounds).map_err(driver(up))?;
        let s = Arc::new(Self {
            market: raw(&market, stream),
            close: raw(&close, stream),
            seg: raw(&seg, stream),
            _market: market,
            _close: close,
            _seg: seg,
            device: device.clone(),
        });
        live.push(Entry { data: Arc::downgrade(data), series: Arc::downgrade(&s) });
        Ok(s)
    }
}
