//! The run's GPU busy fraction (`fx_hw::busy::BusyMeter`: the driver's utilisation samples,
//! the share of time in which a kernel ran), per metrics interval and over the run. Absent
//! (null in the files) on the CPU, in a build without `cuda`, or where the driver's NVML
//! library cannot be loaded (the reason goes into the run's profile).

use candle_core::Device;

/// See the module docs.
pub(crate) struct GpuBusy {
    #[cfg(feature = "cuda")]
    meter: Option<fx_hw::busy::BusyMeter>,
    /// Why there is no meter on a GPU run (None: there is one, or the run is on the CPU).
    pub(crate) unavailable: Option<String>,
}

impl GpuBusy {
    /// Starts measuring `device` now.
    pub(crate) fn for_device(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        if let candle_core::DeviceLocation::Cuda { gpu_id } = device.location() {
            return match fx_hw::busy::BusyMeter::for_cuda_ordinal(gpu_id) {
                Ok(m) => Self { meter: Some(m), unavailable: None },
                Err(why) => Self { meter: None, unavailable: Some(why) },
            };
        }
        let _ = device;
        Self {
            #[cfg(feature = "cuda")]
            meter: None,
            unavailable: None,
        }
    }

    /// The busy fraction since the previous call (None: no meter, or no sample yet).
    pub(crate) fn interval(&mut self) -> Option<f64> {
        #[cfg(feature = "cuda")]
        if let Some(m) = self.meter.as_mut() {
            return m.fraction_since_last();
        }
        None
    }

    /// The busy fraction over the whole measured span (reads the last interval first).
    pub(crate) fn total(&mut self) -> Option<f64> {
        let _ = self.interval();
        #[cfg(feature = "cuda")]
        if let Some(m) = self.meter.as_ref() {
            return m.fraction_total();
        }
        None
    }
}
