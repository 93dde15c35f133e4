//! Counter-based dropout masks: element `i` of dropout call `call` at training step
//! `step` is kept when `draw(seed, STREAM_DROPOUT, call, step·2³² + i) ≥ p`, and a kept
//! element is scaled by `1/(1 − p)` (inverted dropout).
//!
//! Why not a stateful generator: a CUDA graph captures a generator's offset by value, so
//! every replay would drop the same units. Here the step comes from device memory (the
//! kernels of `kernels/train/dropout.cu` read it there), so a replayed training step draws fresh
//! masks, the same ones on every backend and on resume. [`mask_reference`] is what the
//! kernels are tested against.

#[cfg(feature = "cuda")]
pub mod cuda;

use fx_kernels::rng::draw;

/// Stream of the dropout draws (the environment uses 0–3).
pub const STREAM_DROPOUT: u64 = 4;

/// Elements one dropout call may have: their index shares the 64-bit counter with the step.
pub const MAX_ELEMENTS: usize = 1 << 32;

/// The factor a kept element is multiplied by, as F32 (computed once, the same everywhere).
pub fn keep_scale(p: f64) -> f32 {
    (1.0 / (1.0 - p)) as f32
}

/// The scaled mask of `n` elements: `1/(1−p)` where kept, 0 where dropped.
pub fn mask_reference(seed: u64, call: u64, step: u32, n: usize, p: f64) -> Vec<f32> {
    let scale = keep_scale(p);
    let hi = (step as u64) << 32;
    (0..n as u64).map(|i| if draw(seed, STREAM_DROPOUT, call, hi | i) >= p { scale } else { 0.0 }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_about_one_minus_p_and_scales_them() {
        let m = mask_reference(7, 3, 11, 20_000, 0.1);
        let kept = m.iter().filter(|&&v| v != 0.0).count() as f64 / m.len() as f64;
        assert!((kept - 0.9).abs() < 0.01, "kept fraction {kept}");
        assert!(m.iter().all(|&v| v == 0.0 || v == keep_scale(0.1)));
    }

    #[test]
    fn calls_and_steps_draw_different_masks_and_repeat_exactly() {
        let a = mask_reference(7, 3, 11, 512, 0.5);
        // The module's definition spelled out on its own: stream 4, counter step·2³² + i,
        // kept iff the draw is at least p, a kept element scaled by 1/(1 − 0.5) = 2.
        let want: Vec<f32> =
            (0..512u64).map(|i| if draw(7, 4, 3, 11 * 4_294_967_296 + i) >= 0.5 { 2.0 } else { 0.0 }).collect();
        assert_eq!(a, want);
        // An element depends on its index only: a longer call starts with the same mask.
        assert_eq!(a[..], mask_reference(7, 3, 11, 1024, 0.5)[..512]);
        assert_ne!(a, mask_reference(7, 4, 11, 512, 0.5));
        assert_ne!(a, mask_reference(7, 3, 12, 512, 0.5));
        assert_ne!(a, mask_reference(8, 3, 11, 512, 0.5));
    }

    #[test]
    fn zero_probability_keeps_everything_unscaled() {
        assert!(mask_reference(1, 0, 0, 100, 0.0).iter().all(|&v| v == 1.0));
    }
}
