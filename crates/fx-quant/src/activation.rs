//! The hidden layers' squashing on the INT8 path, written so that the compiler vectorises
//! it (no libm call per element): ReLU, and `tanh` as a rational function.
//!
//! The INT8 policy and its scalar reference call the same functions, so their results are
//! bit-identical; the accuracy of [`tanh_rational`] against f64 `tanh` is tested here
//! (its error, ~1e-6, is far below the INT8 step of the next layer's input, 1/127 of its
//! range).

/// `tanh(x)` as `x · P(x²) / Q(x²)` on `[-7.9053, 7.9053]` (beyond, `±1` in f32), the
/// minimax rational approximation used by Eigen and XLA for F32.
#[inline(always)]
// The published constants, digit for digit (f32 rounds them the same way); `max`/`min`
// rather than `clamp`, see below.
#[allow(clippy::excessive_precision, clippy::manual_clamp)]
pub fn tanh_rational(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    const A1: f32 = 4.893_524_6e-3;
    const A3: f32 = 6.372_619_3e-4;
    const A5: f32 = 1.485_722_4e-5;
    const A7: f32 = 5.122_297e-8;
    const A9: f32 = -8.604_672e-11;
    const A11: f32 = 2.000_188e-13;
    const A13: f32 = -2.760_768_5e-16;
    const B0: f32 = 4.893_525_2e-3;
    const B2: f32 = 2.268_434_6e-3;
    const B4: f32 = 1.185_347_1e-4;
    const B6: f32 = 1.198_258_4e-6;
    // `max`/`min` rather than `clamp`: a NaN cannot reach here (inputs are checked), and
    // these compile to vector min/max.
    let x = x.max(-CLAMP).min(CLAMP);
    let x2 = x * x;
    let p = x2 * (x2 * (x2 * (x2 * (x2 * (x2 * A13 + A11) + A9) + A7) + A5) + A3) + A1;
    let q = x2 * (x2 * (x2 * B6 + B4) + B2) + B0;
    x * p / q
}

/// `max(x, 0)`.
#[inline(always)]
pub fn relu(x: f32) -> f32 {
    x.max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tanh_rational_is_within_2e_6_of_tanh() {
        let mut worst = 0.0f64;
        for k in -40_000..=40_000 {
            let x = k as f32 * 0.00025;
            let e = (tanh_rational(x) as f64 - (x as f64).tanh()).abs();
            worst = worst.max(e);
        }
        for x in [9.0f32, 20.0, 1e6, f32::MAX] {
            assert!((tanh_rational(x) - 1.0).abs() < 1e-6 && (tanh_rational(-x) + 1.0).abs() < 1e-6, "{x}");
        }
        assert!(worst <= 2e-6, "worst error {worst}");
        assert_eq!(tanh_rational(0.0), 0.0);
        assert_eq!(relu(-1.0), 0.0);
    }
}
