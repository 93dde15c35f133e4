//! The INT8 greedy policies that `cuda::mlp` runs as one kernel (`kernels/mlp/mlp_int8.cu`):
//! their description ([`I8Mlp`]: fx-quant's quantised layers, borrowed), the shape and
//! limit checks, and the device layout the kernel reads (weights input-major, in 4-byte
//! words of four INT8 values). Everything here runs on the CPU.
//!
//! What the kernel computes, bit for bit, is `fx_quant::reference::reference_scores`; its
//! device tests live in fx-quant (`gpu_policy.rs`) beside that reference, since this crate
//! sits below the quantiser. The rounding rules are written out in the kernel's header.

use crate::mlp::reference::{Activation, Head, MlpDims, MAX_HIDDEN};
use fx_kernels::{Error, Result};

/// Layers of the kernel's parameter block: [`MAX_HIDDEN`] hidden and a two-layer head.
pub const MAX_LAYERS: usize = MAX_HIDDEN + 2;
/// Threads per block for `rows` rows per block: 512 for one or two rows (`fx_mlp_i8_greedy`'s
/// `__launch_bounds__`), for more loads in flight; 256 for more rows
/// (`fx_mlp_i8_greedy_wide`), for fewer lanes per output (fewer shuffles) and several blocks
/// an SM. The split came in with other changes in the H200's run 3 (batch 8192: 232 → 143
/// µs for the DQN) and was not measured apart.
pub fn block_threads(rows: u32) -> u32 {
    if rows <= 2 {
        512
    } else {
        256
    }
}
/// Shared memory a block may use (the static limit: no opt-in attribute needed).
const SMEM_LIMIT: usize = 48 * 1024;

/// One dense layer's weights: INT8 with per-output-channel scales, or kept in F32.
#[derive(Debug, Clone, Copy)]
pub enum I8Weights<'a> {
    /// `y[o] = float(Σ_i w[o,i]·xq[i]) · (weight_scale[o] · step) + bias[o]`.
    Int8 {
        /// `[out, in]` row-major, in `[-127, 127]`.
        weight: &'a [i8],
        /// `[out]`, finite and > 0.
        weight_scale: &'a [f32],
        /// The stored input step (finite, > 0), or `None`: each row's `max |x| / 127`.
        input_scale: Option<f32>,
    },
    /// `y[o] = Σ_i w[o,i]·x[i] + bias[o]`, summed in input order.
    F32 {
        /// `[out, in]` row-major.
        weight: &'a [f32],
    },
}

/// A dense layer: `out` outputs of `inp` inputs.
#[derive(Debug, Clone, Copy)]
pub struct I8Linear<'a> {
    /// Output width.
    pub out: usize,
    /// Input width.
    pub inp: usize,
    /// The weights.
    pub weights: I8Weights<'a>,
    /// `[out]`.
    pub bias: &'a [f32],
}

/// An INT8 greedy policy: `hidden` layers in order (each followed by its activation; for
/// this kernel [`Activation::Tanh`] is fx-quant's rational tanh, the CPU INT8 path's), then
/// `head`. The action is the first index of the largest score.
#[derive(Debug, Clone)]
pub struct I8Mlp<'a> {
    /// The activated layers, input first.
    pub hidden: Vec<(I8Linear<'a>, Activation)>,
    /// The output layer(s).
    pub head: Head<I8Linear<'a>>,
}

/// `struct FxMlpI8Params` of mlp_int8.cu, field for field (both sides assert 256 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MlpI8Params {
    pub(crate) w: [u64; MAX_LAYERS],
    pub(crate) w_scale: [u64; MAX_LAYERS],
    pub(crate) b: [u64; MAX_LAYERS],
    pub(crate) in_scale: [f32; MAX_LAYERS],
    pub(crate) in_width: [u32; MAX_LAYERS],
    pub(crate) out_width: [u32; MAX_LAYERS],
    pub(crate) act: [u32; MAX_HIDDEN],
    pub(crate) int8_mask: u32,
    pub(crate) n_hidden: u32,
    pub(crate) n_actions: u32,
    pub(crate) head: u32,
    pub(crate) rows: u32,
    pub(crate) stride: u32,
}
const _: () = assert!(std::mem::size_of::<MlpI8Params>() == 256);

/// The device image of an [`I8Mlp`]: every layer's weights in one `u32` buffer (INT8 layers
/// as words `[ceil(in/4)][out4]`, `out4` = `out` rounded up to a multiple of 4, starting at a
/// multiple of 4 words; byte `j` of word `(k, o)` = `w[o, 4k + j]`, zero past `in` and
/// `out`; F32 layers as the bits of `[in][out]`), the scales and biases in one `f32` buffer, and the
/// offsets of each layer in them. [`I8Image::params`] turns the two buffers' device
/// addresses into the kernel's parameter block.
#[derive(Debug, Clone, PartialEq)]
pub struct I8Image {
    /// Weight words.
    pub words: Vec<u32>,
    /// Weight scales and biases.
    pub floats: Vec<f32>,
    /// The network's dimensions.
    pub dims: MlpDims,
    params: MlpI8Params,
    /// Per layer: (offset in `words`, offset of the scales in `floats` (INT8 layers), offset
    /// of the bias in `floats`).
    offsets: Vec<(usize, Option<usize>, usize)>,
}

impl I8Mlp<'_> {
    /// Every layer in the kernel's order: hidden, then the head (logits; or value, advantage).
    fn layers(&self) -> Vec<&I8Linear<'_>> {
        let mut v: Vec<&I8Linear<'_>> = self.hidden.iter().map(|(l, _)| l).collect();
        match &self.head {
            Head::Logits(l) => v.push(l),
            Head::Dueling { value, advantage } => v.extend([value, advantage]),
        }
        v
    }

    /// Checks every layer (lengths, finite scales > 0, each layer's input the previous
    /// layer's output, a dueling value of one output) and the kernel's limits (beyond them,
    /// [`Error::Unsupported`]).
    pub fn dims(&self) -> Result<MlpDims> {
        const CTX: &str = "I8Mlp::dims";
        let layers = self.layers();
        let input = layers[0].inp;
        let mut width = input;
        let n_head = layers.len() - self.hidden.len();
        for (i, l) in layers.iter().enumerate() {
            let head = i >= self.hidden.len();
            if l.inp != width || l.out == 0 {
                return Err(Error::shape(
                    "layer",
                    CTX,
                    format!("[out >= 1, {width}] (layer {i})"),
                    format!("[{}, {}]", l.out, l.inp),
                ));
            }
            let n_w = match l.weights {
                I8Weights::Int8 { weight, weight_scale, input_scale } => {
                    if weight_scale.len() != l.out {
                        return Err(Error::shape("weight_scale", CTX, l.out, weight_scale.len()));
                    }
                    if let Some((o, s)) = weight_scale.iter().enumerate().find(|(_, s)| !(s.is_finite() && **s > 0.0)) {
                        return Err(Error::Config {
                            context: CTX,
                            message: format!("layer {i} weight_scale[{o}] = {s}: must be finite and > 0"),
                        });
                    }
                    if let Some(s) = input_scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
                        return Err(Error::Config {
                            context: CTX,
                            message: format!("layer {i} input_scale {s}: must be finite and > 0"),
                        });
                    }
                    if let Some((k, w)) = weight.iter().enumerate().find(|(_, w)| **w == i8::MIN) {
                        return Err(Error::Config {
                            context: CTX,
                            message: format!("layer {i} weight[{k}] = {w}: outside ±127"),
                        });
                    }
                    weight.len()
                }
                I8Weights::F32 { weight } => weight.len(),
            };
            if n_w != l.out * l.inp {
                return Err(Error::shape("weight", CTX, l.out * l.inp, n_w));
            }
            if l.bias.len() != l.out {
                return Err(Error::shape("bias", CTX, l.out, l.bias.len()));
            }
            if !head {
                width = l.out;
            }
        }
        let n_actions = layers[layers.len() - 1].out;
        if n_head == 2 && layers[layers.len() - 2].out != 1 {
            return Err(Error::shape("value", CTX, "1 output", layers[layers.len() - 2].out));
        }
        let hidden = self.hidden.iter().map(|(l, _)| l.out).collect();
        let dims = MlpDims { input, hidden, n_actions };
        dims.check_limits("INT8 greedy MLP")?;
        Ok(dims)
    }

    /// The checked network's device image.
    pub fn image(&self) -> Result<I8Image> {
        let dims = self.dims()?;
        let mut p = MlpI8Params::default();
        let (mut words, mut floats, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
        for (i, l) in self.layers().into_iter().enumerate() {
            let at = words.len();
            let mut offsets_at = at;
            let scales = match l.weights {
                I8Weights::Int8 { weight, weight_scale, input_scale } => {
                    // 16-byte aligned, rows of `out` padded to a multiple of 4 (uint4 loads).
                    let at = at.div_ceil(4) * 4;
                    let (k4, out4) = (l.inp.div_ceil(4), l.out.div_ceil(4) * 4);
                    words.resize(at + k4 * out4, 0);
                    for o in 0..l.out {
                        for (k, &w) in weight[o * l.inp..(o + 1) * l.inp].iter().enumerate() {
                            words[at + (k / 4) * out4 + o] |= u32::from(w as u8) << (8 * (k % 4));
                        }
                    }
                    offsets_at = at;
                    p.int8_mask |= 1 << i;
                    p.in_scale[i] = input_scale.unwrap_or(0.0);
                    floats.extend_from_slice(weight_scale);
                    Some(floats.len() - l.out)
                }
                I8Weights::F32 { weight } => {
                    words.resize(at + l.inp * l.out, 0);
                    for o in 0..l.out {
                        for k in 0..l.inp {
                            words[at + k * l.out + o] = weight[o * l.inp + k].to_bits();
                        }
                    }
                    None
                }
            };
            floats.extend_from_slice(l.bias);
            offsets.push((offsets_at, scales, floats.len() - l.out));
            (p.in_width[i], p.out_width[i]) = (l.inp as u32, l.out as u32);
        }
        for (a, (_, act)) in p.act.iter_mut().zip(&self.hidden) {
            *a = *act as u32;
        }
        p.n_hidden = self.hidden.len() as u32;
        p.n_actions = dims.n_actions as u32;
        p.head = matches!(self.head, Head::Dueling { .. }) as u32;
        let widest = std::iter::once(dims.input).chain(dims.hidden.iter().copied()).max().unwrap_or(1);
        p.stride = widest.div_ceil(4) as u32 * 4;
        Ok(I8Image { words, floats, dims, params: p, offsets })
    }
}

impl I8Image {
    /// The kernel's parameter block for the image uploaded at `words` and `floats` (device
    /// addresses of the two buffers); `rows` per block is set per launch ([`rows_per_block`]).
    pub fn params(&self, words: u64, floats: u64) -> MlpI8Params {
        let mut p = self.params;
        for (i, &(w, s, b)) in self.offsets.iter().enumerate() {
            p.w[i] = words + 4 * w as u64;
            p.w_scale[i] = s.map_or(0, |s| floats + 4 * s as u64);
            p.b[i] = floats + 4 * b as u64;
        }
        p
    }
}

/// Dynamic shared memory of a block of `rows` rows: two activation buffers and the
/// quantised input (`rows × stride` floats and bytes), the steps, the scores and two sets of
/// row maxima.
pub fn smem_bytes(p: &MlpI8Params, rows: u32) -> usize {
    let (r, s) = (rows as usize, p.stride as usize);
    4 * (2 * r * s + r * s / 4 + r + r * (p.n_actions as usize + 1) + 2 * r)
}

/// Rows per block for a batch of `batch` on `sms` SMs: the fewest (1, 2, 4 or 8) that keep
/// the grid within about one block per SM, so small batches spread over the GPU and large
/// ones load each weight word once for several rows; fewer where shared memory is short.
/// The rule is a choice, not a tuned optimum (measured rows-per-block trade-offs are in
/// docs/perf/).
pub fn rows_per_block(p: &MlpI8Params, batch: usize, sms: usize) -> u32 {
    let mut r = 1u32;
    while r < 8 && batch.div_ceil(r as usize) > sms.max(1) && smem_bytes(p, 2 * r) <= SMEM_LIMIT {
        r *= 2;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlp::reference::MAX_WIDTH;

    struct Owned {
        w: Vec<Vec<i8>>,
        wf: Vec<f32>,
        s: Vec<Vec<f32>>,
        b: Vec<Vec<f32>>,
    }

    fn owned(widths: &[usize]) -> Owned {
        let n = widths.len() - 1;
        let w = (0..n)
            .map(|l| (0..widths[l] * widths[l + 1]).map(|k| (((k * 37 + l * 11) % 255) as i32 - 127) as i8).collect())
            .collect();
        let s = (0..n).map(|l| (0..widths[l + 1]).map(|o| 0.01 + o as f32 * 1e-3).collect()).collect();
        let b = (0..n).map(|l| (0..widths[l + 1]).map(|o| o as f32 - 0.5).collect()).collect();
        let wf = (0..widths[n - 1] * widths[n]).map(|k| k as f32 * 0.25).collect();
        Owned { w, wf, s, b }
    }

    fn lin<'a>(o: &'a Owned, widths: &[usize], l: usize, f32_layer: bool) -> I8Linear<'a> {
        let weights = if f32_layer {
            I8Weights::F32 { weight: &o.wf }
        } else {
            I8Weights::Int8 { weight: &o.w[l], weight_scale: &o.s[l], input_scale: (l == 1).then_some(0.5) }
        };
        I8Linear { out: widths[l + 1], inp: widths[l], weights, bias: &o.b[l] }
    }

    #[test]
    fn the_image_holds_every_weight_where_the_kernel_reads_it() {
        let widths = [7usize, 9, 6, 3];
        let o = owned(&widths);
        let net = I8Mlp {
            hidden: vec![
                (lin(&o, &widths, 0, false), Activation::Relu),
                (lin(&o, &widths, 1, false), Activation::Tanh),
            ],
            head: Head::Logits(lin(&o, &widths, 2, true)),
        };
        let img = net.image().unwrap();
        assert_eq!(img.dims, MlpDims { input: 7, hidden: vec![9, 6], n_actions: 3 });
        let p = img.params(1000, 5000);
        assert_eq!((p.int8_mask, p.n_hidden, p.n_actions, p.head, p.stride), (0b011, 2, 3, 0, 12));
        assert_eq!((p.in_scale[0], p.in_scale[1], p.act[0], p.act[1]), (0.0, 0.5, 1, 2));
        for l in 0..2 {
            let (inp, out) = (widths[l], widths[l + 1]);
            let base = ((p.w[l] - 1000) / 4) as usize;
            assert_eq!(base % 4, 0, "layer {l} starts 16-byte aligned");
            let out4 = out.div_ceil(4) * 4;
            for oo in 0..out4 {
                for k in 0..inp.div_ceil(4) * 4 {
                    let byte = (img.words[base + (k / 4) * out4 + oo] >> (8 * (k % 4))) as u8 as i8;
                    let want = if k < inp && oo < out { o.w[l][oo * inp + k] } else { 0 };
                    assert_eq!(byte, want, "layer {l} o {oo} k {k}");
                }
                if oo >= out {
                    continue;
                }
                assert_eq!(img.floats[((p.w_scale[l] - 5000) / 4) as usize + oo], o.s[l][oo]);
                assert_eq!(img.floats[((p.b[l] - 5000) / 4) as usize + oo], o.b[l][oo]);
            }
        }
        let base = ((p.w[2] - 1000) / 4) as usize;
        for oo in 0..3 {
            for k in 0..6 {
                assert_eq!(f32::from_bits(img.words[base + k * 3 + oo]), o.wf[oo * 6 + k]);
            }
        }
        assert_eq!(p.w_scale[2], 0);
    }

    #[test]
    fn bad_layers_and_limits_are_one_line_errors() {
        let widths = [7usize, 9, 6, 3];
        let o = owned(&widths);
        let good = |l| lin(&o, &widths, l, false);
        let mut value = good(2);
        value.out = 3;
        let net = I8Mlp {
            hidden: vec![(good(0), Activation::Relu), (good(1), Activation::Relu)],
            head: Head::Dueling { value, advantage: good(2) },
        };
        let e = net.dims().unwrap_err().to_string();
        assert!(e.contains("value") && !e.contains('\n'), "{e}");
        let net = I8Mlp { hidden: vec![(good(1), Activation::Relu)], head: Head::Logits(good(2)) };
        assert!(net.dims().is_ok());
        let net = I8Mlp { hidden: vec![(good(0), Activation::Relu)], head: Head::Logits(good(2)) };
        assert!(net.dims().unwrap_err().to_string().contains("layer 1"));
        let bad_scale = vec![0.0f32; 9];
        let mut l0 = good(0);
        l0.weights = I8Weights::Int8 { weight: &o.w[0], weight_scale: &bad_scale, input_scale: None };
        let net =
            I8Mlp { hidden: vec![(l0, Activation::Relu), (good(1), Activation::Relu)], head: Head::Logits(good(2)) };
        assert!(net.dims().unwrap_err().to_string().contains("weight_scale[0] = 0"));
        let net = I8Mlp { hidden: vec![], head: Head::Logits(good(0)) };
        assert_eq!(net.dims().unwrap().n_actions, 9);
        let wide: Vec<i8> = vec![1; 2 * (MAX_WIDTH + 1)];
        let (s2, b2) = (vec![1.0f32; 2], vec![0.0f32; 2]);
        let l = I8Linear {
            out: 2,
            inp: MAX_WIDTH + 1,
            weights: I8Weights::Int8 { weight: &wide, weight_scale: &s2, input_scale: None },
            bias: &b2,
        };
        let e = I8Mlp { hidden: vec![], head: Head::Logits(l) }.dims().unwrap_err();
        assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    }

    #[test]
    fn rows_per_block_fill_the_device_within_shared_memory() {
        let mut p = MlpI8Params { stride: 256, n_actions: 3, ..Default::default() };
        assert_eq!(rows_per_block(&p, 1, 132), 1);
        assert_eq!(rows_per_block(&p, 132, 132), 1);
        assert_eq!(rows_per_block(&p, 256, 132), 2);
        assert_eq!(rows_per_block(&p, 8192, 132), 8);
        assert!(smem_bytes(&p, 8) <= SMEM_LIMIT);
        p.stride = 1024;
        assert_eq!(rows_per_block(&p, 8192, 132), 4);
        assert!(smem_bytes(&p, 4) <= SMEM_LIMIT);
    }
}
