//! The PyTorch-layout affine map shared by the RL networks, under the precision policy.

use candle_core::{Module, Result, Tensor};
use fx_precision::{Linear, Precision, PrecisionExt};

/// `y = x · wᵀ + b` with `w [o, i]`, `b [o]` (PyTorch `Linear`) through fx-precision's
/// [`Linear`]: input and weights cast to the compute dtype (autocast-style, the casts are
/// graph nodes so gradients reach the F32 variables), output in the compute dtype.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, precision: Precision) -> Result<Tensor> {
    Linear::from_parts(w.clone(), Some(b.clone()), precision)?.forward(x)
}

/// [`linear`] for N members at once: `x [N, R, i]`, `w [N, o, i]`, `b [N, o]` (the same
/// casts, GEMM and bias add, batched over the leading axis: member k's rows are the values
/// [`linear`] gives member k's slices on the CPU).
pub(crate) fn linear_members(x: &Tensor, w: &Tensor, b: &Tensor, p: Precision) -> Result<Tensor> {
    let x = p.to_compute(x)?;
    let w = p.to_compute(w)?;
    x.matmul(&w.transpose(1, 2)?)?.broadcast_add(&p.to_compute(b)?.unsqueeze(1)?)
}
