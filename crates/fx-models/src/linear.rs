//! The PyTorch-layout affine map shared by the RL networks, with the compute dtype of
//! the precision policy applied autocast-style.

use candle_core::{DType, Result, Tensor};

/// `y = x · wᵀ + b` with `w [o, i]`, `b [o]` (PyTorch `Linear`), computed in `compute`.
///
/// Master weights stay F32; under BF16/F16 compute the weights and the input are cast
/// for the matmul, as `torch.autocast` does, and the cast is part of the graph so the
/// gradient reaches the F32 variables.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: &Tensor, compute: DType) -> Result<Tensor> {
    let cast = |t: &Tensor| {
        if t.dtype() == compute {
            Ok(t.clone())
        } else {
            t.to_dtype(compute)
        }
    };
    let (x, w, b) = (cast(x)?, cast(w)?, cast(b)?);
    x.matmul(&w.t()?)?.broadcast_add(&b)
}
