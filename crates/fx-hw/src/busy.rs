//! GPU busy time as the driver counts it, for run profiles: NVML's utilisation samples, each
//! the share of one sampling period (1/6 s to 1 s, by product) in which at least one kernel
//! ran on the GPU — the number `nvidia-smi` shows. NVML ships with the NVIDIA driver
//! (`libnvidia-ml.so.1`) and is loaded at run time, so nothing links against it; where it
//! cannot be loaded the meter is absent and [`BusyMeter::for_cuda_ordinal`] says why.
//!
//! The samples cover the whole GPU, so another process's kernels count as busy too.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `nvmlSample_t`: a timestamp (µs) and an 8-byte value union.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NvmlSample {
    time_stamp: u64,
    value: u64,
}

type NvmlDevice = *mut c_void;
type InitFn = unsafe extern "C" fn() -> c_int;
type HandleByPciFn = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_int;
type GetSamplesFn = unsafe extern "C" fn(NvmlDevice, c_int, u64, *mut c_int, *mut c_uint, *mut NvmlSample) -> c_int;

const NVML_SUCCESS: c_int = 0;
const NVML_GPU_UTILIZATION_SAMPLES: c_int = 1;

/// Reads one sample's value (percent) from NVML's union by its type tag (`nvmlValueType_t`).
fn sample_percent(value: u64, value_type: c_int) -> Option<f64> {
    match value_type {
        0 => Some(f64::from_bits(value)),
        1 | 5 => Some((value & 0xffff_ffff) as u32 as f64),
        2 | 3 => Some(value as f64),
        4 => Some(value as i64 as f64),
        _ => None,
    }
}

/// The mean of the samples (timestamp µs, percent) taken strictly after `after`, as a
/// fraction in [0, 1], with the newest timestamp and the number of samples; `None` when
/// there is none.
pub fn mean_busy_after(samples: &[(u64, f64)], after: u64) -> Option<(f64, u64, usize)> {
    let fresh: Vec<&(u64, f64)> = samples.iter().filter(|(t, v)| *t > after && v.is_finite()).collect();
    let newest = fresh.iter().map(|(t, _)| *t).max()?;
    let mean = fresh.iter().map(|(_, v)| v.clamp(0.0, 100.0)).sum::<f64>() / fresh.len() as f64 / 100.0;
    Some((mean, newest, fresh.len()))
}

/// NVML utilisation samples of one GPU, read interval by interval (see the module docs).
pub struct BusyMeter {
    // Field order: the device handle and functions are only valid while `_lib` is loaded.
    device: NvmlDevice,
    get_samples: GetSamplesFn,
    last_seen: u64,
    total: (f64, usize),
    _lib: libloading::Library,
}

impl std::fmt::Debug for BusyMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusyMeter").field("last_seen", &self.last_seen).finish()
    }
}

// SAFETY: the handle is an opaque NVML pointer; NVML's calls are thread-safe.
unsafe impl Send for BusyMeter {}

impl BusyMeter {
    /// The meter of CUDA device `ordinal` (matched to NVML by PCI bus id, so
    /// `CUDA_VISIBLE_DEVICES` is respected), starting now. The error says why there is
    /// none (no driver library, an NVML error code).
    pub fn for_cuda_ordinal(ordinal: usize) -> Result<Self, String> {
        use cudarc::driver::sys;
        let mut bus = [0 as c_char; 32];
        // SAFETY: plain driver queries into local buffers (the CUDA context exists: the
        // caller opened the device).
        unsafe {
            let mut dev: sys::CUdevice = 0;
            let r = sys::cuDeviceGet(&mut dev, ordinal as c_int);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuDeviceGet({ordinal}): {r:?}"));
            }
            let r = sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev);
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuDeviceGetPCIBusId: {r:?}"));
            }
        }
        // SAFETY: loading the driver's NVML library runs no foreign initialiser beyond its own.
        let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }
            .map_err(|e| format!("libnvidia-ml.so.1 not loadable: {e}"))?;
        // SAFETY: the symbols' C signatures are NVML's (nvml.h), used while `lib` lives.
        unsafe {
            let init: libloading::Symbol<InitFn> = lib.get(b"nvmlInit_v2\0").map_err(|e| e.to_string())?;
            let by_pci: libloading::Symbol<HandleByPciFn> =
                lib.get(b"nvmlDeviceGetHandleByPciBusId_v2\0").map_err(|e| e.to_string())?;
            let get_samples: libloading::Symbol<GetSamplesFn> =
                lib.get(b"nvmlDeviceGetSamples\0").map_err(|e| e.to_string())?;
            let r = init();
            if r != NVML_SUCCESS {
                return Err(format!("nvmlInit_v2: NVML error {r}"));
            }
            let mut device: NvmlDevice = std::ptr::null_mut();
            let r = by_pci(bus.as_ptr(), &mut device);
            if r != NVML_SUCCESS {
                return Err(format!("nvmlDeviceGetHandleByPciBusId_v2: NVML error {r}"));
            }
            let get_samples = *get_samples;
            let mut me = Self { device, get_samples, last_seen: 0, total: (0.0, 0), _lib: lib };
            // Start from the newest sample the driver holds now.
            me.last_seen = me.samples(0).iter().map(|s| s.0).max().unwrap_or(0);
            Ok(me)
        }
    }

    /// The samples after `after` (timestamp µs, percent); empty when NVML has none.
    fn samples(&self, after: u64) -> Vec<(u64, f64)> {
        let (mut vtype, mut n): (c_int, c_uint) = (0, 0);
        // SAFETY: a null sample array asks for the count; then an array of that many.
        unsafe {
            let f = self.get_samples;
            if f(self.device, NVML_GPU_UTILIZATION_SAMPLES, after, &mut vtype, &mut n, std::ptr::null_mut())
                != NVML_SUCCESS
                || n == 0
            {
                return Vec::new();
            }
            let mut buf = vec![NvmlSample::default(); n as usize];
            if f(self.device, NVML_GPU_UTILIZATION_SAMPLES, after, &mut vtype, &mut n, buf.as_mut_ptr()) != NVML_SUCCESS
            {
                return Vec::new();
            }
            buf.truncate(n as usize);
            buf.iter().filter_map(|s| sample_percent(s.value, vtype).map(|v| (s.time_stamp, v))).collect()
        }
    }

    /// The busy fraction since the previous call (or the meter's start): the mean of the
    /// samples taken since; `None` when the driver took none (an interval shorter than its
    /// sampling period).
    pub fn fraction_since_last(&mut self) -> Option<f64> {
        let (mean, newest, n) = mean_busy_after(&self.samples(self.last_seen), self.last_seen)?;
        self.total.0 += mean * n as f64;
        self.total.1 += n;
        self.last_seen = newest;
        Some(mean)
    }

    /// The busy fraction over every interval read so far (sample-weighted), if any.
    pub fn fraction_total(&self) -> Option<f64> {
        (self.total.1 > 0).then(|| self.total.0 / self.total.1 as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_of_the_fresh_samples_only() {
        let s = [(10, 50.0), (20, 100.0), (30, 0.0), (40, 100.0)];
        assert_eq!(mean_busy_after(&s, 20), Some((0.5, 40, 2)));
        assert_eq!(mean_busy_after(&s, 0), Some((0.625, 40, 4)));
        assert_eq!(mean_busy_after(&s, 40), None);
        assert_eq!(mean_busy_after(&[], 0), None);
        // Out-of-range values are clamped, non-finite ones ignored.
        assert_eq!(mean_busy_after(&[(1, 150.0), (2, f64::NAN)], 0), Some((1.0, 1, 1)));
    }

    #[test]
    fn sample_values_by_type() {
        assert_eq!(sample_percent(0.75f64.to_bits(), 0), Some(0.75));
        assert_eq!(sample_percent(0xdead_0000_0000_0042, 1), Some(66.0));
        assert_eq!(sample_percent(7, 3), Some(7.0));
        assert_eq!(sample_percent(7, 99), None);
    }
}
