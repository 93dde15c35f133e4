//! Many tensors read to the host with one stream synchronisation: [`to_host`] (in every
//! build; without the `cuda` feature every tensor is already on the host).
//!
//! `Tensor::to_device(&Device::Cpu)` makes one blocking copy per tensor (the driver stages
//! a pageable destination through its own buffer and waits), and for a view it copies the
//! whole underlying buffer. A trainer's checkpoint snapshot reads some 70 small tensors, so
//! the GPU sat idle while the host waited on each copy in turn. Here every small tensor is
//! queued as an asynchronous copy of exactly its bytes into one page-locked staging buffer,
//! the stream is synchronised once, and the host tensors are cut from the buffer. Tensors
//! of `DIRECT_BYTES` or more go straight to their own host memory (bandwidth-bound
//! anyway); the staging buffer stays at most `STAGING_BYTES` and is flushed when full.

use candle_core::{Device, Tensor};

use crate::error::{CandleContext, Result};
#[cfg(feature = "cuda")]
use cuda_path::*;

/// Host (CPU) copies of `tensors`, in order, equal bit for bit to `t.to_device(&Device::Cpu)`
/// (same dtype, shape and values). CPU tensors are returned as they are (shared storage,
/// as `to_device` does). CUDA tensors are read after the work queued on their stream.
pub fn to_host(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if tensors.iter().any(|t| t.device().is_cuda()) {
        return to_host_cuda(tensors);
    }
    tensors.iter().map(|t| t.to_device(&Device::Cpu).ctx("readback::to_host")).collect()
}

/// The CUDA path: staging, direct copies, the device address of a tensor of any dtype.
#[cfg(feature = "cuda")]
mod cuda_path {
    use std::sync::Mutex;

    use candle_core::{DType, Device, Storage, Tensor};
    use cudarc::driver::{result, CudaStream, DevicePtr, PinnedHostSlice};

    use crate::cuda::driver;
    use crate::error::{CandleContext, Error, Result};

    /// Tensors of this many bytes or more are copied on their own, not staged.
    pub const DIRECT_BYTES: usize = 1 << 20;
    /// The page-locked staging buffer's size (allocated once per process, on first use).
    pub const STAGING_BYTES: usize = 8 << 20;
    /// Offsets inside the staging buffer are aligned to this many bytes.
    const ALIGN: usize = 16;

    /// The process's staging buffer (page-locked host memory of one CUDA context; replaced if
    /// a tensor of another context comes).
    static STAGING: Mutex<Option<PinnedHostSlice<u8>>> = Mutex::new(None);
    // Every staged tensor fits the buffer on its own.
    const _: () = assert!(DIRECT_BYTES <= STAGING_BYTES);

    pub(super) fn to_host_cuda(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        const CTX: &str = "cuda::readback::to_host";
        let mut out: Vec<Option<Tensor>> = vec![None; tensors.len()];
        // (index, contiguous tensor, bytes) of the tensors to stage.
        let mut staged: Vec<(usize, Tensor, usize)> = Vec::new();
        // One stream for all (checked before anything is queued).
        let mut stream: Option<std::sync::Arc<CudaStream>> = None;
        for t in tensors.iter().filter(|t| t.device().is_cuda()) {
            let s = stream_of(t, CTX)?;
            if stream.as_ref().is_some_and(|first| !std::sync::Arc::ptr_eq(first, &s)) {
                return Err(Error::Device {
                    what: "tensors",
                    expected: "every CUDA tensor on one device".into(),
                    context: CTX,
                });
            }
            stream.get_or_insert(s);
        }
        for (i, t) in tensors.iter().enumerate() {
            let Device::Cuda(_) = t.device() else {
                out[i] = Some(t.clone());
                continue;
            };
            let bytes = t.elem_count() * t.dtype().size_in_bytes();
            if bytes == 0 || bytes >= DIRECT_BYTES || t.dtype().size_in_bytes() == 0 {
                out[i] = Some(direct(t).ctx(CTX)?);
                continue;
            }
            // A strided view is gathered on the device first (rare: parameters are contiguous).
            staged.push((i, t.contiguous().ctx(CTX)?, bytes));
        }
        if let (false, Some(stream)) = (staged.is_empty(), stream) {
            let mut guard =
                STAGING.lock().map_err(|_| Error::Cuda { context: CTX, message: "staging lock poisoned".into() })?;
            let mut start = 0;
            while start < staged.len() {
                // The next batch: as many tensors as fit the buffer (each fits: < DIRECT_BYTES).
                let (mut end, mut used) = (start, 0usize);
                while end < staged.len() && used.next_multiple_of(ALIGN) + staged[end].2 <= STAGING_BYTES {
                    used = used.next_multiple_of(ALIGN) + staged[end].2;
                    end += 1;
                }
                let batch = &staged[start..end];
                let buf = staging_for(&mut guard, &stream, CTX)?;
                let host = buf.as_mut_slice().map_err(driver(CTX))?;
                let mut offsets = Vec::with_capacity(batch.len());
                let mut off = 0usize;
                let mut queued = Ok(());
                for (_, t, bytes) in batch {
                    off = off.next_multiple_of(ALIGN);
                    queued = queue_copy(t, &stream, &mut host[off..off + bytes], CTX);
                    if queued.is_err() {
                        break;
                    }
                    offsets.push(off);
                    off += bytes;
                }
                // Also after a failed copy: the copies queued before it must land before the
                // buffer is released.
                let synced = stream.synchronize().map_err(driver(CTX));
                queued?;
                synced?;
                for ((i, t, bytes), off) in batch.iter().zip(offsets) {
                    let h =
                        Tensor::from_raw_buffer(&host[off..off + bytes], t.dtype(), t.dims(), &Device::Cpu).ctx(CTX)?;
                    out[*i] = Some(h);
                }
                start = end;
            }
        }
        Ok(out.into_iter().map(|t| t.expect("every tensor was read")).collect())
    }

    /// One tensor on its own: a contiguous copy of exactly its elements, then to the host.
    fn direct(t: &Tensor) -> candle_core::Result<Tensor> {
        let whole = {
            let (storage, layout) = t.storage_and_layout();
            let len = match &*storage {
                Storage::Cuda(cs) => cuda_len(cs),
                _ => None,
            };
            layout.is_contiguous() && layout.start_offset() == 0 && len == Some(t.elem_count())
        };
        // A view into a larger buffer is gathered into a buffer of its own first, so that only
        // its bytes cross (`copy` would clone the whole buffer).
        let t = if whole { t.clone() } else { t.force_contiguous()? };
        t.to_device(&Device::Cpu)
    }

    /// Elements in a CUDA storage's buffer (None: a dtype not listed here).
    fn cuda_len(cs: &candle_core::CudaStorage) -> Option<usize> {
        use candle_core::backend::BackendStorage;
        macro_rules! len {
            ($($d:ident => $t:ty),*) => {
                match cs.dtype() {
                    $(DType::$d => cs.as_cuda_slice::<$t>().ok().map(|s| s.len()),)*
                    _ => None,
                }
            };
        }
        len!(U8 => u8, U32 => u32, I16 => i16, I32 => i32, I64 => i64, BF16 => half::bf16, F16 => half::f16, F32 => f32, F64 => f64)
    }

    /// The stream of `t`'s CUDA device.
    fn stream_of(t: &Tensor, ctx: &'static str) -> Result<std::sync::Arc<CudaStream>> {
        match t.device() {
            Device::Cuda(d) => Ok(d.cuda_stream()),
            _ => Err(Error::Device { what: "tensor", expected: "a CUDA device".into(), context: ctx }),
        }
    }

    /// The staging buffer, (re)allocated for `stream`'s context when absent or of another one.
    fn staging_for<'a>(
        slot: &'a mut Option<PinnedHostSlice<u8>>,
        stream: &CudaStream,
        ctx: &'static str,
    ) -> Result<&'a mut PinnedHostSlice<u8>> {
        let same = slot.as_ref().is_some_and(|b| b.context().cu_ctx() == stream.context().cu_ctx());
        if !same {
            *slot = None;
            // Flags 0, not cudarc's default write-combined memory: the host reads this buffer,
            // and reads of write-combined memory are uncached and slow.
            // SAFETY: the memory is zeroed through its raw pointer before any slice of it is
            // made.
            let mut b =
                unsafe { stream.context().alloc_pinned_with_flags::<u8>(STAGING_BYTES, 0) }.map_err(driver(ctx))?;
            let p = b.as_mut_ptr().map_err(driver(ctx))?;
            unsafe { std::ptr::write_bytes(p, 0, STAGING_BYTES) };
            *slot = Some(b);
        }
        Ok(slot.as_mut().expect("allocated above"))
    }

    /// Queues the copy of a contiguous CUDA tensor's bytes (any dtype, its layout's offset
    /// applied) into `dst` (exactly its size) on `stream`.
    fn queue_copy(t: &Tensor, stream: &CudaStream, dst: &mut [u8], ctx: &'static str) -> Result<()> {
        let (storage, layout) = t.storage_and_layout();
        if !layout.is_contiguous() || dst.len() != t.elem_count() * t.dtype().size_in_bytes() {
            return Err(Error::shape("tensor", ctx, "a contiguous tensor of the destination's size", "a strided view"));
        }
        let Storage::Cuda(cs) = &*storage else {
            return Err(Error::Device { what: "tensor", expected: "a CUDA device".into(), context: ctx });
        };
        let offset = (layout.start_offset() * t.dtype().size_in_bytes()) as u64;
        macro_rules! copy {
            ($($d:ident => $t:ty),*) => {
                match t.dtype() {
                    $(DType::$d => {
                        let s = cs.as_cuda_slice::<$t>().ctx(ctx)?;
                        // The guard records cudarc's read event when dropped: after the copy.
                        let (ptr, _record) = s.device_ptr(stream);
                        // SAFETY: `ptr + offset` addresses `dst.len()` bytes of the slice's live
                        // buffer (contiguous, size checked above); `dst` is the caller's part
                        // of the page-locked buffer, untouched until the stream is synchronised
                        // (the caller holds the lock), and `t` outlives that synchronisation.
                        unsafe { result::memcpy_dtoh_async(dst, ptr + offset, stream.cu_stream()) }
                            .map_err(driver(ctx))
                    })*
                    other => Err(Error::shape("tensor", ctx, "a dtype CUDA storage holds", format!("{other:?}"))),
                }
            };
        }
        copy!(U8 => u8, U32 => u32, I16 => i16, I32 => i32, I64 => i64, BF16 => half::bf16, F16 => half::f16, F32 => f32, F64 => f64)
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::cuda_path::{DIRECT_BYTES, STAGING_BYTES};
    use super::*;
    use crate::cuda::tests::gpu;
    use candle_core::DType;

    /// Fresh random tensors of every staged dtype, views with offsets, a strided view, an
    /// empty tensor, one above the direct threshold and a CPU tensor, read in one call:
    /// each equals its own `to_device(Cpu)` bit for bit (dtype, shape, bytes).
    #[test]
    fn many_tensors_read_as_to_device_does() {
        let Some(dev) = gpu("readback::many_tensors_read_as_to_device_does") else { return };
        let seed = fx_hw::test_seed(concat!(module_path!(), ":", line!()));
        let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let flat = r(&[10_000]);
        let mut ts = vec![
            r(&[3, 7]),
            r(&[1]).to_dtype(DType::F64).unwrap(),
            r(&[5, 4]).to_dtype(DType::BF16).unwrap(),
            r(&[9]).to_dtype(DType::F16).unwrap(),
            Tensor::arange(0i64, 13, &dev).unwrap(),
            Tensor::arange(3u32, 40, &dev).unwrap(),
            Tensor::arange(0u8, 200, &dev).unwrap(),
            // Views: a narrow of a flat buffer (offset), reshaped; a transpose (strided).
            flat.narrow(0, 1_234, 600).unwrap().reshape((20, 30)).unwrap(),
            r(&[6, 11]).t().unwrap(),
            Tensor::zeros((0, 4), DType::F32, &dev).unwrap(),
            // Over the direct threshold, and a big view.
            r(&[DIRECT_BYTES / 4 + 17]),
            r(&[700_000]).narrow(0, 5, 300_000).unwrap(),
            Tensor::new(&[1.5f32, -2.0], &Device::Cpu).unwrap(),
        ];
        // Enough small tensors to need more than one staging batch.
        for k in 0..(STAGING_BYTES / (256 << 10) + 3) {
            ts.push(r(&[(256 << 10) / 4 - k]));
        }
        let got = to_host(&ts).unwrap();
        assert_eq!(got.len(), ts.len());
        for (i, (t, h)) in ts.iter().zip(&got).enumerate() {
            let want = t.to_device(&Device::Cpu).unwrap();
            assert!(h.device().is_cpu(), "tensor {i} (seed {seed})");
            assert_eq!((h.dtype(), h.dims()), (want.dtype(), want.dims()), "tensor {i}");
            let bytes = |x: &Tensor| {
                let x = x.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
                x.to_vec1::<f64>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(bytes(h), bytes(&want), "tensor {i}: values differ");
        }
    }

    /// Tensors read after more device work see that work (the copies are stream-ordered).
    #[test]
    fn reads_after_queued_work() {
        let Some(dev) = gpu("readback::reads_after_queued_work") else { return };
        let a = Tensor::ones(1000, DType::F32, &dev).unwrap();
        let mut b = a.clone();
        for _ in 0..50 {
            b = (b * 1.01).unwrap();
        }
        let got = to_host(&[b.clone()]).unwrap();
        let want = 1.01f32.powi(50);
        let v = got[0].to_vec1::<f32>().unwrap();
        assert!(v.iter().all(|x| (x - want).abs() < 1e-4 && x.is_finite()), "{:?}", &v[..3]);
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::*;

    /// On the host, tensors come back as they are: same dtype, shape and values.
    #[test]
    fn host_tensors_come_back_equal() {
        let a = Tensor::new(&[[1.5f32, -2.0], [3.0, 4.25]], &Device::Cpu).unwrap();
        let b = Tensor::arange(0u32, 5, &Device::Cpu).unwrap();
        let got = to_host(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(got[0].to_vec2::<f32>().unwrap(), a.to_vec2::<f32>().unwrap());
        assert_eq!(got[1].to_vec1::<u32>().unwrap(), [0, 1, 2, 3, 4]);
        assert!(to_host(&[]).unwrap().is_empty());
    }
}
