//! The PyTorch-layout affine map shared by the RL networks, under the precision policy.

use candle_core::{Module, Result, Tensor};
use fx_precision::{Linear, Precision};

/// `y = x · wᵀ + b` with `w [o, i]`, `b [o]` (PyTorch `Linear`) through fx-precision's
/// [`Linear`]: input and weights cast to the compute dtype (autocast-style, the casts are
/// graph nodes so gradients reach the F32 variables), output in the compute dtype.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, precision: Precision) -> Result<Tensor> {
    Linear::from_parts(w.clone(), Some(b.clone()), precision)?.forward(x)
}
