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

/// The fresh samples (timestamp µs, percent) taken strictly after `after`, as a weighted
/// sum of fractions and the sum of weights, with the newest timestamp; `None` when there is
/// none. Every sample weighs 1, except that the first one's period, `(after, t]`, is
/// clipped to begin at `start` when `clip` (the share of that period after `start`): the
/// sample that straddles the moment measuring began counts only for its part after it.
pub fn busy_after(samples: &[(u64, f64)], after: u64, start: u64, clip: bool) -> Option<(f64, f64, u64)> {
    let mut fresh: Vec<(u64, f64)> = samples.iter().copied().filter(|(t, v)| *t > after && v.is_finite()).collect();
    fresh.sort_by_key(|s| s.0);
    let newest = fresh.last()?.0;
    let (mut sum, mut weight) = (0.0, 0.0);
    for (i, (t, v)) in fresh.iter().enumerate() {
        let w = if i == 0 && clip && after > 0 && start > after {
            t.saturating_sub(start) as f64 / (t - after) as f64
        } else {
            1.0
        };
        sum += w * v.clamp(0.0, 100.0) / 100.0;
        weight += w;
    }
    Some((sum, weight, newest))
}

/// Microseconds since the Unix epoch now (NVML's sample clock, checked at run time).
fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// NVML utilisation samples of one GPU, read interval by interval (see the module docs).
pub struct BusyMeter {
    // Field order: the device handle and functions are only valid while `_lib` is loaded.
    device: NvmlDevice,
    get_samples: GetSamplesFn,
    last_seen: u64,
    /// When measuring began (µs since the epoch), and whether NVML's timestamps are on that
    /// clock (a sample taken within the last 5 s when the meter was made), so that the first
    /// sample's period can be clipped to it.
    start: u64,
    clip: bool,
    total: (f64, f64),
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
            let mut me =
                Self { device, get_samples, last_seen: 0, start: 0, clip: false, total: (0.0, 0.0), _lib: lib };
            // Start from the newest sample the driver holds now.
            me.last_seen = me.samples(0).iter().map(|s| s.0).max().unwrap_or(0);
            me.start = now_us();
            me.clip = me.last_seen > 0 && me.start.abs_diff(me.last_seen) < 5_000_000;
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
    /// samples taken since, the first sample after the start counting only for the part of
    /// its period after it ([`busy_after`]: before this, up to one sampling period of the
    /// idle setup before a training loop counted as the loop's); `None` when the driver took
    /// none (an interval shorter than its sampling period).
    pub fn fraction_since_last(&mut self) -> Option<f64> {
        let (sum, weight, newest) = busy_after(&self.samples(self.last_seen), self.last_seen, self.start, self.clip)?;
        self.total.0 += sum;
        self.total.1 += weight;
        self.last_seen = newest;
        (weight > 0.0).then(|| sum / weight)
    }

    /// The busy fraction over every interval read so far (sample-weighted), if any.
    pub fn fraction_total(&self) -> Option<f64> {
        (self.total.1 > 0.0).then(|| self.total.0 / self.total.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every fresh sample weighs 1 but the first, which counts for the share of its period
    /// `(after, t]` after `start` when clipping (timestamps on the same clock).
    #[test]
    fn the_sample_straddling_the_start_counts_for_its_part_after_it() {
        let s = [(100, 0.0), (200, 100.0), (300, 100.0)];
        // Measuring began at 175: the sample at 200 covers (100, 200], a quarter of it after.
        assert_eq!(busy_after(&s, 100, 175, true).unwrap(), (1.25, 1.25, 300));
        let (sum, w, _) = busy_after(&[(200, 0.0), (300, 100.0)], 100, 175, true).unwrap();
        assert!((sum / w - 1.0 / 1.25).abs() < 1e-12);
        // Unclipped, or a start before the period: plain means (NaN skipped, percent clamped).
        assert_eq!(busy_after(&[(200, 0.0), (300, 100.0)], 100, 175, false).unwrap(), (1.0, 2.0, 300));
        assert_eq!(busy_after(&[(200, 0.0), (300, 100.0), (250, f64::NAN)], 100, 50, true).unwrap(), (1.0, 2.0, 300));
        assert_eq!(busy_after(&[(200, 150.0)], 100, 0, true).unwrap(), (1.0, 1.0, 200));
        // No sample before (after = 0): nothing to clip against.
        assert_eq!(busy_after(&[(200, 50.0)], 0, 150, true).unwrap(), (0.5, 1.0, 200));
        assert_eq!(busy_after(&s, 300, 0, true), None);
        assert_eq!(busy_after(&[], 0, 0, true), None);
        // A start after the sample: it weighs nothing.
        assert_eq!(busy_after(&[(200, 100.0), (300, 50.0)], 100, 250, true).unwrap(), (0.5, 1.0, 300));
    }

    #[test]
    fn sample_values_by_type() {
        assert_eq!(sample_percent(0.75f64.to_bits(), 0), Some(0.75));
        assert_eq!(sample_percent(0xdead_0000_0000_0042, 1), Some(66.0));
        assert_eq!(sample_percent(7, 3), Some(7.0));
        assert_eq!(sample_percent(7, 99), None);
    }
}
