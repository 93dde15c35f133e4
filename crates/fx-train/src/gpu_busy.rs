//! The run's GPU busy fraction (`fx_hw::busy::BusyMeter`: the driver's utilisation samples,
//! the share of time in which a kernel ran), per metrics interval and over the run. Absent
//! (null in the files) on the CPU, in a build without `cuda`, or where the driver's NVML
//! library cannot be loaded (the reason goes into the run's profile).
//!
//! The driver samples every 1/6 s to 1 s, so the meter is asked at most every
//! [`MIN_READ_INTERVAL`]: a metrics interval shorter than that reads null (a read would find
//! no new sample) instead of making a driver call while the GPU waits for the loop (DQN on
//! the H200 logs every 50 steps, about every 20 ms: 200 lines in the 3.9 s loop of
//! `docs/perf/2026-12-02-h200-iteration-graphs/runs.log`'s 10,000-step run).

use std::time::{Duration, Instant};

use candle_core::Device;

/// The shortest time between two reads of the driver's samples.
pub(crate) const MIN_READ_INTERVAL: Duration = Duration::from_millis(500);

/// See the module docs.
pub(crate) struct GpuBusy {
    #[cfg(feature = "cuda")]
    meter: Option<fx_hw::busy::BusyMeter>,
    /// Why there is no meter on a GPU run (None: there is one, or the run is on the CPU).
    pub(crate) unavailable: Option<String>,
    last_read: Instant,
}

impl GpuBusy {
    /// Starts measuring `device` now.
    pub(crate) fn for_device(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        if let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() {
            return match fx_hw::busy::BusyMeter::for_cuda_ordinal(gpu_id) {
                Ok(m) => Self { meter: Some(m), unavailable: None, last_read: Instant::now() },
                Err(why) => Self { meter: None, unavailable: Some(why), last_read: Instant::now() },
            };
        }
        let _ = device;
        Self {
            #[cfg(feature = "cuda")]
            meter: None,
            unavailable: None,
            last_read: Instant::now(),
        }
    }

    /// The busy fraction since the previous read (None: no meter, no sample yet, or less
    /// than [`MIN_READ_INTERVAL`] since the last read, which then carries over).
    pub(crate) fn interval(&mut self) -> Option<f64> {
        if self.last_read.elapsed() < MIN_READ_INTERVAL {
            return None;
        }
        self.read()
    }

    fn read(&mut self) -> Option<f64> {
        self.last_read = Instant::now();
        #[cfg(feature = "cuda")]
        if let Some(m) = self.meter.as_mut() {
            return m.fraction_since_last();
        }
        None
    }

    /// The busy fraction over the whole measured span (reads the last interval first).
    pub(crate) fn total(&mut self) -> Option<f64> {
        let _ = self.read();
        #[cfg(feature = "cuda")]
        if let Some(m) = self.meter.as_ref() {
            return m.fraction_total();
        }
        None
    }
}
