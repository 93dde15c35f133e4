//! Opening a CUDA device the way fx runs on it (feature `cuda`): [`open_cuda`] for code,
//! [`test_gpu`] for tests, and [`device_wide_lock`], which CUDA-graph capture holds.
//!
//! Why not candle's `Device::new_cuda`: it runs on CUDA's per-thread default stream, and
//! candle keeps thread-local device buffers (its graph-capture upload cache) that are freed
//! when the thread exits, on a per-thread stream that is then already gone: test binaries
//! with graphs crashed at thread exit (SIGSEGV). fx instead gives every device a stream of
//! its own, valid for the device's whole life whichever thread holds it.
//!
//! Why a lock: a CUDA graph is captured per stream, in thread-local mode, but some driver
//! and library calls on *another* thread synchronise the whole device — creating a stream
//! on a fresh context (cudarc synchronises it), `cublasDestroy` (documented to call
//! `cudaDeviceSynchronize`), module loads — and a device-wide synchronisation during a
//! capture invalidates it (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, or cuBLAS failing
//! inside the capture). So captures, device creation and device teardown take one
//! process-wide lock, cuBLAS handles are made once per device (fx's GEMMs share candle's), and devices are never torn down: [`open_cuda`] keeps each device it
//! made in a pool and hands a pooled one out again once nothing else holds it (no device
//! clone, tensor, graph or cached buffer refers to its stream any more).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Device;

use crate::error::Error;

/// A device fx made, and how many references to its stream it holds itself.
struct Pooled {
    ordinal: usize,
    device: Device,
    own_refs: usize,
}

static POOL: Mutex<Vec<Pooled>> = Mutex::new(Vec::new());
static DEVICE_WIDE: Mutex<()> = Mutex::new(());

/// The process-wide lock held while a CUDA graph is captured and while a device is made
/// (see the module docs). Never hold it while calling [`open_cuda`].
pub fn device_wide_lock() -> MutexGuard<'static, ()> {
    // A panic while holding it leaves no state behind to repair.
    DEVICE_WIDE.lock().unwrap_or_else(|p| p.into_inner())
}

fn stream_refs(device: &Device) -> usize {
    match device {
        // Minus the temporary clone `cuda_stream()` returns.
        Device::Cuda(d) => Arc::strong_count(&d.cuda_stream()) - 1,
        _ => 0,
    }
}

/// CUDA device `ordinal` on a stream of its own, with cudarc's per-tensor event tracking
/// off (fx orders all of a device's work on its one stream, where events only add work).
/// Fails with the driver's reason when there is no such device or no driver at all.
pub fn open_cuda(ordinal: usize) -> Result<Device, Error> {
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = pool.iter().find(|p| p.ordinal == ordinal && stream_refs(&p.device) == p.own_refs) {
        return Ok(p.device.clone());
    }
    let _wide = device_wide_lock();
    // cudarc's dynamic loading panics when libcuda cannot be loaded: contain that.
    let made = std::panic::catch_unwind(|| Device::new_cuda_with_stream(ordinal)).map_err(|_| Error::Driver {
        during: "opening a CUDA device",
        message: "the CUDA driver library could not be loaded".into(),
    })?;
    let device = made.map_err(|e| Error::Driver { during: "opening a CUDA device", message: e.to_string() })?;
    if let Device::Cuda(d) = &device {
        // SAFETY: every launch fx makes on this device goes to its one stream, so ordering
        // needs no events; the context was created just now by this call (not shared).
        unsafe { d.disable_event_tracking() };
    }
    let own_refs = stream_refs(&device);
    pool.push(Pooled { ordinal, device: device.clone(), own_refs });
    Ok(device)
}

/// The first CUDA device for a test, or `None` with a note on stderr when there is none.
/// Panics instead when `FX_REQUIRE_GPU=1`, so a device run never counts a skip as a pass.
pub fn test_gpu(test: &str) -> Option<Device> {
    match open_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("FX_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{test}: FX_REQUIRE_GPU=1 but no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("{test}: skipped, no CUDA device ({e})");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_of(d: &Device) -> usize {
        let Device::Cuda(c) = d else { panic!("not a CUDA device") };
        c.cuda_stream().cu_stream() as usize
    }

    #[test]
    fn a_device_is_never_handed_out_while_anything_refers_to_it() {
        let Some(a) = test_gpu("a_device_is_never_handed_out_while_anything_refers_to_it") else { return };
        let b = open_cuda(0).expect("second device");
        assert_ne!(stream_of(&a), stream_of(&b), "a held device was handed out again");
        // A tensor keeps its device's stream alive: dropping the device alone is not enough.
        let t = candle_core::Tensor::zeros(4, candle_core::DType::F32, &a).expect("tensor");
        let a_stream = stream_of(&a);
        drop(a);
        let c = open_cuda(0).expect("third device");
        assert_ne!(stream_of(&c), a_stream, "a device with a live tensor was handed out again");
        assert_eq!(t.to_vec1::<f32>().expect("read back"), vec![0.0; 4]);
    }
}
