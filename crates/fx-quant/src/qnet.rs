//! The quantised network ([`QuantNet`]): per-output-channel symmetric INT8 weights with
//! their scales, each layer's input scale, F32 biases, and the layers kept in F32.
//!
//! A quantised layer computes `y[o] = (Σ_i wq[o,i] · xq[i]) · (w_scale[o] · input_scale) +
//! bias[o]` with `wq = clamp(round(w / w_scale[o]), ±127)`, `w_scale[o] = max_i |w[o,i]| /
//! 127`, and `xq = clamp(round(x / input_scale), ±127)` (round half to even, in F32).

use crate::error::{Error, Result};
use crate::float_net::{check_chain, check_layer_values, FloatLayer, FloatNet, PolicyKind};
use crate::gemv_i8::{padded, row_sums};

/// One INT8 Linear.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantLinear {
    /// Spec name (e.g. `trunk.0`).
    pub name: String,
    /// Output width.
    pub out: usize,
    /// Input width.
    pub inp: usize,
    /// `out × inp` weights in `[-127, 127]`, row-major.
    pub weight: Vec<i8>,
    /// Per output channel, finite and > 0.
    pub weight_scale: Vec<f32>,
    /// The input's step, finite and > 0.
    pub input_scale: f32,
    /// `out` F32 biases.
    pub bias: Vec<f32>,
}

impl QuantLinear {
    /// `l`'s weights quantised row by row ([`quantize_row`]), its bias kept, with
    /// `input_scale` (unused by layers run with dynamic input scales).
    pub fn from_f32(l: &FloatLayer, input_scale: f32) -> Self {
        let mut weight = Vec::with_capacity(l.weight.len());
        let mut weight_scale = Vec::with_capacity(l.out);
        for row in l.weight.chunks_exact(l.inp) {
            let (q, s) = quantize_row(row);
            weight.extend(q);
            weight_scale.push(s);
        }
        Self { name: l.name.clone(), out: l.out, inp: l.inp, weight, weight_scale, input_scale, bias: l.bias.clone() }
    }
}

/// A layer of a [`QuantNet`].
#[derive(Debug, Clone, PartialEq)]
pub enum QuantLayer {
    /// Quantised.
    Int8(QuantLinear),
    /// Kept in F32 (see [`QuantNet::quantize`]'s `keep_f32`).
    F32(FloatLayer),
}

impl QuantLayer {
    /// The layer's spec name.
    pub fn name(&self) -> &str {
        match self {
            QuantLayer::Int8(l) => &l.name,
            QuantLayer::F32(l) => &l.name,
        }
    }

    /// `(out, inp)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            QuantLayer::Int8(l) => (l.out, l.inp),
            QuantLayer::F32(l) => (l.out, l.inp),
        }
    }

    /// Bytes its parameters take (weights, scales, biases).
    pub fn bytes(&self) -> usize {
        match self {
            QuantLayer::Int8(l) => l.weight.len() + 4 * (l.weight_scale.len() + 1 + l.bias.len()),
            QuantLayer::F32(l) => 4 * (l.weight.len() + l.bias.len()),
        }
    }
}

/// How a network was calibrated (recorded in the checkpoint).
#[derive(Debug, Clone, PartialEq)]
pub struct CalibInfo {
    /// `minmax` or `percentile`.
    pub method: String,
    /// The percentile, for `percentile`.
    pub percentile: Option<f64>,
    /// Observations the scales came from.
    pub rows: usize,
    /// A policy's decision margin ([`crate::guard::decision_margin`], metadata
    /// `decision_margin`): INT8 gaps between the two best actions at or below it are decided
    /// in F32 by a [`crate::GuardedPolicy`]. `None` for files written before margins and for
    /// forecasters.
    pub decision_margin: Option<f32>,
}

/// A quantised greedy policy network: what the checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantNet {
    /// Which network.
    pub kind: PolicyKind,
    /// The layers in [`PolicyKind::layer_names`] order.
    pub layers: Vec<QuantLayer>,
    /// How the input scales were found.
    pub calibration: CalibInfo,
}

/// The weights of one row quantised symmetrically: `(q, scale)`.
pub fn quantize_row(row: &[f32]) -> (Vec<i8>, f32) {
    let max = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // An all-zero row: any positive scale gives zeros; 1 keeps the file's scales > 0.
    let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
    (row.iter().map(|&w| (w / scale).round_ties_even().clamp(-127.0, 127.0) as i8).collect(), scale)
}

/// The one rounding rule for activations: `clamp(round_half_even(x · inv_scale), ±127)`,
/// computed in F32 (so the vectorised and the scalar paths agree to the bit).
#[inline(always)]
// `max`/`min` compile to vector min/max; inputs are checked finite, so `clamp`'s NaN rule
// never matters.
#[allow(clippy::manual_clamp)]
pub fn quantize_input(x: f32, inv_scale: f32) -> i8 {
    (x * inv_scale).round_ties_even().max(-127.0).min(127.0) as i8
}

impl QuantNet {
    /// Quantises `net` with per-layer `input_scales` (from [`crate::calibrate::input_scales`]);
    /// the layers named in `keep_f32` stay F32.
    pub fn quantize(net: &FloatNet, input_scales: &[f32], keep_f32: &[&str], calibration: CalibInfo) -> Result<Self> {
        net.check()?;
        if input_scales.len() != net.layers.len() {
            return Err(Error::Length {
                what: "input scales",
                expected: net.layers.len(),
                got: input_scales.len(),
                context: "QuantNet::quantize",
            });
        }
        for name in keep_f32 {
            if !net.kind.layer_names().contains(name) {
                return Err(Error::invalid(
                    "F32 layer",
                    format!("{name} is not a {} layer (they are {:?})", net.kind.as_str(), net.kind.layer_names()),
                ));
            }
        }
        let mut layers = Vec::with_capacity(net.layers.len());
        for (l, &input_scale) in net.layers.iter().zip(input_scales) {
            if !(input_scale.is_finite() && input_scale > 0.0) {
                return Err(Error::invalid("input scale", format!("{}: {input_scale} is not finite and > 0", l.name)));
            }
            if keep_f32.contains(&l.name.as_str()) {
                layers.push(QuantLayer::F32(l.clone()));
                continue;
            }
            layers.push(QuantLayer::Int8(QuantLinear::from_f32(l, input_scale)));
        }
        let q = Self { kind: net.kind, layers, calibration };
        q.check()?;
        Ok(q)
    }

    /// The structure is `kind`'s network, lengths match, weights are in `[-127, 127]`,
    /// scales finite and > 0, biases and F32 weights finite.
    pub fn check(&self) -> Result<()> {
        check_chain(self.kind, self.layers.iter().map(|l| (l.name(), l.dims().0, l.dims().1)))?;
        for layer in &self.layers {
            match layer {
                QuantLayer::F32(l) => check_layer_values(l)?,
                QuantLayer::Int8(l) => {
                    let bad = |m: String| Err(Error::invalid("quantised layer", format!("{}: {m}", l.name)));
                    if l.weight.len() != l.out * l.inp || l.weight_scale.len() != l.out || l.bias.len() != l.out {
                        return bad(format!(
                            "{} weights, {} scales, {} biases for [{}, {}]",
                            l.weight.len(),
                            l.weight_scale.len(),
                            l.bias.len(),
                            l.out,
                            l.inp
                        ));
                    }
                    if let Some(i) = l.weight.iter().position(|&w| w == i8::MIN) {
                        return bad(format!("weight {i} is -128 (symmetric INT8 is [-127, 127])"));
                    }
                    if let Some(i) = l.weight_scale.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
                        return bad(format!("weight_scale {i} = {} is not finite and > 0", l.weight_scale[i]));
                    }
                    if !(l.input_scale.is_finite() && l.input_scale > 0.0) {
                        return bad(format!("input_scale {} is not finite and > 0", l.input_scale));
                    }
                    if let Some(i) = l.bias.iter().position(|b| !b.is_finite()) {
                        return bad(format!("bias {i} = {} is not finite", l.bias[i]));
                    }
                }
            }
        }
        Ok(())
    }

    /// Input width.
    pub fn state_dim(&self) -> usize {
        self.layers[0].dims().1
    }

    /// Number of actions.
    pub fn n_actions(&self) -> usize {
        self.layers.last().map_or(0, |l| l.dims().0)
    }

    /// Bytes of all parameters as stored (INT8 weights, F32 scales and biases).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(QuantLayer::bytes).sum()
    }

    /// Whether each call takes its input steps from its own inputs (calibration method
    /// `dynamic`) rather than the stored `input_scale`s.
    pub fn dynamic_inputs(&self) -> bool {
        self.calibration.method == crate::calibrate::DYNAMIC
    }

    /// Names of the layers kept in F32.
    pub fn f32_layers(&self) -> Vec<&str> {
        self.layers.iter().filter(|l| matches!(l, QuantLayer::F32(_))).map(QuantLayer::name).collect()
    }
}

/// The input step of one call under dynamic scales: `max |x| / 127` (1 for an all-zero
/// input, whose codes are all 0 anyway). The one rule the policy and the reference share.
#[inline(always)]
pub(crate) fn dynamic_input_scale(x: &[f32]) -> f32 {
    step_of_abs_max(abs_max(x))
}

/// `max |x|` (0 for an empty or all-NaN `x`: a NaN never replaces the running maximum).
#[inline(always)]
pub(crate) fn abs_max(x: &[f32]) -> f32 {
    // 32 running maxima (four chains of eight lanes under AVX2, two of sixteen under
    // AVX-512), then eight for the tail, so the loop is bounded by its loads, not by one
    // chain's latency. `above` rather than `f32::max`: the compiler guards `f32::max` against
    // NaNs with a compare and a blend in every step, three dependent instructions (on the
    // H200 host's Xeon that chain took longer than the dequantising loop before it); the
    // select is one `maxps`. The maximum of non-negative values does not depend on the
    // order, so the result is the same.
    #[inline(always)]
    fn above(m: f32, v: f32) -> f32 {
        let a = v.abs();
        if a > m {
            a
        } else {
            m
        }
    }
    let mut wide = [0.0f32; 32];
    let chunks = x.chunks_exact(32);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &v) in wide.iter_mut().zip(c) {
            *m = above(*m, v);
        }
    }
    let mut lanes = [0.0f32; 8];
    for w in wide.chunks_exact(8) {
        for (m, &v) in lanes.iter_mut().zip(w) {
            *m = above(*m, v);
        }
    }
    let eights = rest.chunks_exact(8);
    let tail = eights.remainder();
    for c in eights {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = above(*m, v);
        }
    }
    tail.iter().chain(&lanes).fold(0.0f32, |m, &v| above(m, v))
}

/// The dynamic step of an input whose largest magnitude is `amax` ([`abs_max`]).
#[inline(always)]
pub(crate) fn step_of_abs_max(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / 127.0
    } else {
        1.0
    }
}

/// A quantised layer laid out for the kernels: rows padded to [`crate::gemv_i8::PAD`],
/// row sums, and `w_scale · input_scale` per output (static scales) or `w_scale` alone
/// (dynamic scales: the input's step is each call's).
#[derive(Debug, Clone)]
pub(crate) struct PackedLinear {
    pub(crate) out: usize,
    pub(crate) inp: usize,
    pub(crate) stride: usize,
    pub(crate) weight: Vec<i8>,
    pub(crate) row_sum: Vec<i32>,
    pub(crate) inv_input_scale: f32,
    pub(crate) dequant: Vec<f32>,
    pub(crate) bias: Vec<f32>,
    /// Dynamic input scales ([`dynamic_input_scale`]); then `dequant` holds `w_scale`.
    pub(crate) dynamic: bool,
}

impl PackedLinear {
    pub(crate) fn new(l: &QuantLinear, dynamic: bool) -> Self {
        let stride = padded(l.inp);
        let mut weight = vec![0i8; l.out * stride];
        for (dst, src) in weight.chunks_exact_mut(stride).zip(l.weight.chunks_exact(l.inp)) {
            dst[..l.inp].copy_from_slice(src);
        }
        Self {
            out: l.out,
            inp: l.inp,
            stride,
            row_sum: row_sums(&weight, stride, l.out),
            weight,
            inv_input_scale: 1.0 / l.input_scale,
            dequant: if dynamic {
                l.weight_scale.clone()
            } else {
                l.weight_scale.iter().map(|s| s * l.input_scale).collect()
            },
            bias: l.bias.clone(),
            dynamic,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// `abs_max` (32 and 8 lanes, then the tail) is the plain running maximum of the
        /// magnitudes, bit for bit, for every length class, with NaNs skipped.
        #[test]
        fn abs_max_is_the_plain_maximum(
            x in prop::collection::vec(prop_oneof![8 => -1e6f32..1e6, 1 => Just(f32::NAN), 1 => Just(-0.0f32)], 0..200),
        ) {
            let want = x.iter().filter(|v| !v.is_nan()).fold(0.0f32, |m, v| m.max(v.abs()));
            prop_assert_eq!(abs_max(&x).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn rows_quantise_symmetrically_per_channel() {
        let (q, s) = quantize_row(&[0.5, -1.0, 0.25, 0.0]);
        assert_eq!(s, 1.0 / 127.0);
        assert_eq!(q, vec![64, -127, 32, 0]); // 63.5 rounds to even 64
        let (q, s) = quantize_row(&[0.0, 0.0]);
        assert_eq!((q, s), (vec![0, 0], 1.0));
        assert_eq!(quantize_input(1e30, 1.0), 127);
        assert_eq!(quantize_input(-1e30, 1.0), -127);
        assert_eq!(quantize_input(2.5, 1.0), 2);
        assert_eq!(quantize_input(-3.5, 1.0), -4);
    }
}
