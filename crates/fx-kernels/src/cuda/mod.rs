//! CUDA backend (feature `cuda`): the experience kernels of `kernels/env/*.cu`, loaded from
//! the PTX in `ptx/` through cudarc on candle's CUDA device and stream, so every launch is
//! ordered with candle's own work on the same tensors; and the plumbing every crate above
//! launches its own kernels with: [`cuda_device`], [`dev_ptr`] and [`address`],
//! [`alloc_tensor`], [`sm_count`], [`driver`] (error mapping), [`LaunchPlan`] and [`blas`].
//!
//! Interop: kernels read and write candle tensors in place through raw device pointers
//! taken from `Tensor::storage_and_layout()`. This is sound because all of them run on the
//! candle device's single stream and cudarc frees memory stream-ordered (or after a
//! stream sync), so a tensor dropped right after a launch is freed after the kernel.

pub mod blas;
mod blas_lt;
pub(crate) mod dqn_loop;
mod gpu_env;
mod gpu_series;
mod launch;
mod pop_collect;

#[cfg(test)]
pub(crate) mod tests;

pub use dqn_loop::{DqnLoop, DqnLoopCounters};
pub use gpu_env::{
    bench_env_steps, bytes_per_env_step, EnvBenchMode, EnvBenchResult, GpuEnvOptions, GpuEnvState, GpuTradingEnv,
};
pub use launch::LaunchPlan;
pub use pop_collect::PopDqnCollect;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{DevicePtr, DeviceRepr};

use crate::checks::expect_tensor;
use crate::error::{CandleContext, Error, Result};
use crate::gae::GaeConfig;

/// PTX of `kernels/env/env_step.cu` (observe, step, selection, DQN experience).
pub(crate) const PTX_ENV_STEP: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/env_step.ptx"));
/// PTX of `kernels/env/ppo_experience.cu`.
pub(crate) const PTX_PPO: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/ppo_experience.ptx"));
/// PTX of `kernels/env/gae.cu`.
pub(crate) const PTX_GAE: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/gae.ptx"));
/// PTX of `kernels/env/replay.cu` (keyed replay sampling, the DQN loop's device counters).
pub(crate) const PTX_REPLAY: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/ptx/replay.ptx"));

/// Maps a cudarc driver error into this crate's error.
pub fn driver(context: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { context, message: format!("{e:?}") }
}

/// The device's number of streaming multiprocessors (grid bounds), through `stream`'s context.
pub fn sm_count(stream: &cudarc::driver::CudaStream, ctx: &'static str) -> Result<u32> {
    let n = stream
        .context()
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(driver(ctx))?;
    Ok(n.max(1) as u32)
}

/// The candle CUDA device behind `device`, or an error naming `what`.
pub fn cuda_device<'a>(device: &'a Device, what: &'static str, ctx: &'static str) -> Result<&'a CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        _ => Err(Error::Device { what, expected: "a CUDA device".into(), context: ctx }),
    }
}

/// Raw device pointer (byte address of the first element) of a contiguous CUDA tensor of
/// element type `T`. The caller keeps `t` alive across the launch.
pub fn dev_ptr<T: candle_core::cuda::CudaDType + DeviceRepr>(
    t: &Tensor,
    stream: &cudarc::driver::CudaStream,
    what: &'static str,
    ctx: &'static str,
) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        return Err(Error::shape(what, ctx, "a contiguous tensor", "a strided view"));
    }
    let Storage::Cuda(cs) = &*storage else {
        return Err(Error::Device { what, expected: "a CUDA device".into(), context: ctx });
    };
    let slice = cs.as_cuda_slice::<T>().ctx(ctx)?;
    let (ptr, _record) = slice.device_ptr(stream);
    Ok(ptr + (layout.start_offset() * std::mem::size_of::<T>()) as u64)
}

/// Address of a contiguous CUDA tensor of element type `T` (`address::<f32>(t, "weights")`),
/// for kernels that take raw addresses (the fused optimiser tail, the fused training steps);
/// an error names `what` when `t` is not a CUDA tensor of `T`. The caller keeps `t` alive
/// (and its storage in place) while launches use the address.
pub fn address<T: candle_core::WithDType + candle_core::cuda::CudaDType + DeviceRepr>(
    t: &Tensor,
    what: &'static str,
) -> Result<u64> {
    const CTX: &str = "cuda::address";
    let dev = cuda_device(t.device(), what, CTX)?;
    if t.dtype() != T::DTYPE {
        return Err(Error::DType { what, expected: T::DTYPE, got: t.dtype(), context: CTX });
    }
    dev_ptr::<T>(t, &dev.cuda_stream(), what, CTX)
}

/// A new uninitialised `[shape]` tensor of `T` on `dev`; every element must be written by
/// the kernel it is allocated for. `shape` must hold at least one element.
pub fn alloc_tensor<T: candle_core::cuda::CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    shape: &[usize],
    ctx: &'static str,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    if n == 0 {
        return Err(Error::shape("output", ctx, "at least one element", format!("{shape:?}")));
    }
    // SAFETY: the memory is fully written by the kernel before anyone reads it.
    let slice = unsafe { dev.cuda_stream().alloc::<T>(n) }.map_err(driver(ctx))?;
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
}

/// GAE on the device (`kernels/env/gae.cu`): `rewards`, `values`, `dones` `[T, E]` f32,
/// `last_value` `[E]` f32 → `(advantages, returns)` `[T, E]` f32.
pub fn gae_device(
    rewards: &Tensor,
    values: &Tensor,
    dones: &Tensor,
    last_value: &Tensor,
    cfg: GaeConfig,
) -> Result<(Tensor, Tensor)> {
    let ctx = "cuda::gae_device";
    let dev = rewards.device().clone();
    let cdev = cuda_device(&dev, "rewards", ctx)?;
    let (t_len, e) = rewards.dims2().ctx(ctx)?;
    expect_tensor(rewards, "rewards", ctx, &[t_len, e], DType::F32, &dev)?;
    expect_tensor(values, "values", ctx, &[t_len, e], DType::F32, &dev)?;
    expect_tensor(dones, "dones", ctx, &[t_len, e], DType::F32, &dev)?;
    expect_tensor(last_value, "last_value", ctx, &[e], DType::F32, &dev)?;
    if t_len == 0 || e == 0 || e > u32::MAX as usize || t_len > u32::MAX as usize {
        return Err(Error::shape("rewards", ctx, "[T, E] with 1 <= T, E < 2^32", format!("[{t_len}, {e}]")));
    }
    let (rewards, values, dones, last_value) = (
        rewards.contiguous().ctx(ctx)?,
        values.contiguous().ctx(ctx)?,
        dones.contiguous().ctx(ctx)?,
        last_value.contiguous().ctx(ctx)?,
    );
    let func = cdev.get_or_load_custom_func("fx_gae", "fx_gae", PTX_GAE).ctx(ctx)?.into_cuda_function();
    let plan = LaunchPlan::for_function(&func, cdev, None, ctx)?;
    let stream = cdev.cuda_stream();
    let adv = alloc_tensor::<f32>(cdev, &[t_len, e], ctx)?;
    let ret = alloc_tensor::<f32>(cdev, &[t_len, e], ctx)?;
    let p_r = dev_ptr::<f32>(&rewards, &stream, "rewards", ctx)?;
    let p_v = dev_ptr::<f32>(&values, &stream, "values", ctx)?;
    let p_d = dev_ptr::<f32>(&dones, &stream, "dones", ctx)?;
    let p_lv = dev_ptr::<f32>(&last_value, &stream, "last_value", ctx)?;
    let p_a = dev_ptr::<f32>(&adv, &stream, "advantages", ctx)?;
    let p_ret = dev_ptr::<f32>(&ret, &stream, "returns", ctx)?;
    let (t32, e32) = (t_len as u32, e as u32);
    let mut b = stream.launch_builder(&func);
    use cudarc::driver::PushKernelArg;
    b.arg(&p_r).arg(&p_v).arg(&p_d).arg(&p_lv).arg(&t32).arg(&e32);
    b.arg(&cfg.gamma).arg(&cfg.lambda).arg(&p_a).arg(&p_ret);
    // SAFETY: argument list matches fx_gae's signature; all buffers hold T·E (or E) f32
    // elements as checked above and stay alive until after the launch.
    unsafe { b.launch(plan.config(e)) }.map_err(driver(ctx))?;
    Ok((adv, ret))
}
