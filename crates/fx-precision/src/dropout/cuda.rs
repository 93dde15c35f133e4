//! Launch wrappers of `kernels/train/dropout.cu`: counter-based dropout masks whose step counter
//! lives in device memory ([`crate::dropout`] is the reference and explains why).

use candle_core::{DType, Device, Tensor};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use crate::dropout::{keep_scale, MAX_ELEMENTS};
use fx_kernels::cuda::{alloc_tensor, cuda_device, dev_ptr, driver};
use fx_kernels::{CandleContext, Error, Result};

/// PTX of `kernels/train/dropout.cu` (counter-based dropout masks).
const PTX_DROPOUT: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/dropout.ptx"));

const BLOCK: u32 = 256;
/// Enough blocks to fill an H200 several times over; larger masks loop grid-stride.
const MAX_BLOCKS: usize = 4096;

/// The loaded kernels.
#[derive(Debug, Clone)]
pub struct DropoutKernels {
    mask: CudaFunction,
    advance: CudaFunction,
    dev: candle_core::CudaDevice,
}

impl DropoutKernels {
    /// Loads the kernels on `device` (a CUDA device).
    pub fn load(device: &Device) -> Result<Self> {
        const CTX: &str = "DropoutKernels::load";
        let dev = cuda_device(device, "device", CTX)?.clone();
        let get = |name: &str| -> Result<CudaFunction> {
            Ok(dev.get_or_load_custom_func(name, "fx_dropout", PTX_DROPOUT).ctx(CTX)?.into_cuda_function())
        };
        Ok(Self { mask: get("fx_dropout_mask")?, advance: get("fx_dropout_advance")?, dev })
    }

    fn check_step(&self, step: &Tensor, ctx: &'static str) -> Result<u64> {
        if step.dtype() != DType::U32 || step.elem_count() != 1 {
            return Err(Error::shape("step", ctx, "one U32", format!("{:?} {:?}", step.dtype(), step.dims())));
        }
        dev_ptr::<u32>(step, &self.dev.cuda_stream(), "step", ctx)
    }

    /// The scaled F32 mask of `shape` for dropout call `call` at the step held in `step`
    /// (a one-element U32 tensor on this device), queued on candle's stream.
    pub fn mask(&self, shape: &[usize], seed: u64, call: u64, step: &Tensor, p: f64) -> Result<Tensor> {
        const CTX: &str = "DropoutKernels::mask";
        let n: usize = shape.iter().product();
        if n == 0 || n > MAX_ELEMENTS || !(0.0..1.0).contains(&p) {
            return Err(Error::shape("mask", CTX, "1..2^32 elements and p in [0, 1)", format!("{shape:?}, p {p}")));
        }
        let p_step = self.check_step(step, CTX)?;
        let out = alloc_tensor::<f32>(&self.dev, shape, CTX)?;
        let stream = self.dev.cuda_stream();
        let p_out = dev_ptr::<f32>(&out, &stream, "mask", CTX)?;
        let (n64, scale) = (n as u64, keep_scale(p));
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.mask);
        b.arg(&p_out).arg(&n64).arg(&seed).arg(&call).arg(&p_step).arg(&p).arg(&scale);
        // SAFETY: the arguments match fx_dropout_mask's signature; `out` holds n F32 and
        // `step` one U32, both alive (candle frees stream-ordered) until the kernel ran.
        unsafe { b.launch(cfg) }.map_err(driver(CTX))?;
        Ok(out)
    }

    /// `step += 1` on the device (queued; capturable).
    pub fn advance(&self, step: &Tensor) -> Result<()> {
        const CTX: &str = "DropoutKernels::advance";
        let p_step = self.check_step(step, CTX)?;
        let stream = self.dev.cuda_stream();
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&self.advance);
        b.arg(&p_step);
        // SAFETY: one U32 pointer, alive as above.
        unsafe { b.launch(cfg) }.map_err(driver(CTX))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dropout::mask_reference;

    #[test]
    fn masks_match_the_reference_and_advance_steps() {
        let Some(dev) = fx_hw::test_gpu("dropout masks") else { return };
        let k = DropoutKernels::load(&dev).unwrap();
        let step = Tensor::new(&[41u32], &dev).unwrap();
        for (shape, call, p) in [(vec![3usize, 1000], 7u64, 0.1f64), (vec![1_200_001], 0, 0.5), (vec![5], 99, 0.0)] {
            let seed = 0x5EED ^ call;
            let got: Vec<f32> = k.mask(&shape, seed, call, &step, p).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let n = shape.iter().product();
            assert_eq!(got, mask_reference(seed, call, 41, n, p), "shape {shape:?} p {p}");
        }
        k.advance(&step).unwrap();
        assert_eq!(step.to_vec1::<u32>().unwrap(), vec![42]);
        let got: Vec<f32> = k.mask(&[64], 1, 2, &step, 0.3).unwrap().to_vec1().unwrap();
        assert_eq!(got, mask_reference(1, 2, 42, 64, 0.3));
    }
}
