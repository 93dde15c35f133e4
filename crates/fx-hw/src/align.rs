//! Dimension alignment for tensor cores: hidden sizes are multiples of 8, and the RL
//! state (51 market + 3 portfolio features) is padded with zeros from 54 to 56.

/// Multiple that tensor-core friendly dimensions are rounded up to.
pub const ALIGN: usize = 8;

/// The RL state before padding: 51 market features + position, unrealised PnL, time in position.
pub const STATE_DIM: usize = 54;

/// The padded RL state width (`MODELS.md`: `STATE_DIM_PADDED`).
pub const STATE_DIM_PADDED: usize = pad_to_multiple(STATE_DIM, ALIGN);

/// Rounds `n` up to the next multiple of `multiple` (`multiple` > 0).
///
/// ```
/// assert_eq!(fx_hw::align::pad_to_multiple(54, 8), 56);
/// assert_eq!(fx_hw::align::pad_to_multiple(256, 8), 256);
/// ```
pub const fn pad_to_multiple(n: usize, multiple: usize) -> usize {
    n.div_ceil(multiple) * multiple
}

/// A hidden dimension rounded up to a multiple of [`ALIGN`] (never below `ALIGN`).
pub const fn hidden_dim(n: usize) -> usize {
    if n == 0 {
        ALIGN
    } else {
        pad_to_multiple(n, ALIGN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn state_is_padded_to_56() {
        assert_eq!(STATE_DIM_PADDED, 56);
    }

    proptest! {
        #[test]
        fn hidden_dims_are_aligned_and_minimal(n in 0usize..100_000) {
            let h = hidden_dim(n);
            prop_assert_eq!(h % ALIGN, 0);
            prop_assert!(h >= n);
            prop_assert!(h < n.max(1) + ALIGN);
        }
    }
}
