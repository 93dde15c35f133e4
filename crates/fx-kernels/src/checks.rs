//! Host-side argument checks for tensors (shape, dtype, device) shared by the storage
//! types and the environments; every kernel launch is preceded by these.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Human-readable device name for messages.
pub fn device_name(d: &Device) -> String {
    format!("{:?}", d.location())
}

/// Checks dims, dtype and device of `t`.
pub fn expect_tensor(
    t: &Tensor,
    what: &'static str,
    ctx: &'static str,
    dims: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<()> {
    if t.dims() != dims {
        return Err(Error::shape(what, ctx, format!("{dims:?}"), format!("{:?}", t.dims())));
    }
    if t.dtype() != dtype {
        return Err(Error::DType { what, expected: dtype, got: t.dtype(), context: ctx });
    }
    if !t.device().same_device(device) {
        return Err(Error::Device { what, expected: device_name(device), context: ctx });
    }
    Ok(())
}
