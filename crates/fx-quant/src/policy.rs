//! [`Int8Policy`]: a quantised greedy policy for decisions on the CPU, one observation at a
//! time, on the calling thread: no thread pool, no tensor, no allocation per call (every
//! buffer is sized once, at construction).
//!
//! A decision quantises each INT8 layer's input (`quantize_input`), runs the INT8
//! matrix–vector product of the best ISA this CPU has ([`crate::Isa`]), and dequantises
//! with `w_scale · input_scale` plus the F32 bias; layers kept in F32 use a plain F32 dot
//! product. The whole forward is compiled a second time with AVX2 enabled (chosen at run
//! time), so the quantise / dequantise / activation loops are vectorised too.
//! [`crate::reference::reference_scores`] computes the same thing plainly and the tests
//! require bit-identical scores.

use crate::activation::{relu, tanh_rational};
use crate::error::{first_non_finite, Error, Result};
use crate::float_net::{FloatLayer, PolicyKind};
use crate::gemv_i8::{Gemv, Isa};
use crate::qnet::{dynamic_input_scale, quantize_input, PackedLinear, QuantLayer, QuantNet};

#[derive(Debug, Clone)]
enum Packed {
    Int8(PackedLinear),
    F32(FloatLayer),
}

impl Packed {
    fn out(&self) -> usize {
        match self {
            Packed::Int8(l) => l.out,
            Packed::F32(l) => l.out,
        }
    }
}

/// The read-only half of a policy.
#[derive(Debug, Clone)]
struct Model {
    kind: PolicyKind,
    layers: Vec<Packed>,
    gemv: Gemv,
    state_dim: usize,
    n_actions: usize,
}

/// Buffers reused by every call.
#[derive(Debug, Clone)]
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    xq: Vec<i8>,
    acc: Vec<i32>,
    value: [f32; 1],
    scores: Vec<f32>,
}

/// `Σ w_i x_i` in F32, in order (the F32 layers; shared with the reference).
#[inline(always)]
pub(crate) fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).fold(0.0f32, |s, (a, b)| s + a * b)
}

/// The first index of the largest score (strict `>`: ties keep the earlier action, as
/// candle's and torch's argmax).
#[inline(always)]
pub(crate) fn first_argmax(s: &[f32]) -> usize {
    let mut best = 0;
    for (j, &v) in s.iter().enumerate().skip(1) {
        if v > s[best] {
            best = j;
        }
    }
    best
}

/// One layer: `y = W x + b` (before the activation).
#[inline(always)]
fn dense(layer: &Packed, gemv: Gemv, x: &[f32], y: &mut [f32], xq: &mut [i8], acc: &mut [i32]) {
    match layer {
        Packed::Int8(l) => {
            let (inv, step) = if l.dynamic {
                let s = dynamic_input_scale(&x[..l.inp]);
                (1.0 / s, Some(s))
            } else {
                (l.inv_input_scale, None)
            };
            for (q, &v) in xq[..l.inp].iter_mut().zip(x) {
                *q = quantize_input(v, inv);
            }
            let acc = &mut acc[..l.out];
            gemv.run(&l.weight, l.stride, &xq[..l.stride], &l.row_sum, acc);
            match step {
                // The reference's order: acc · (w_scale · step) + bias.
                Some(s) => {
                    for (((o, &a), &w), &b) in y.iter_mut().zip(acc.iter()).zip(&l.dequant).zip(&l.bias) {
                        *o = a as f32 * (w * s) + b;
                    }
                }
                None => {
                    for (((o, &a), &d), &b) in y.iter_mut().zip(acc.iter()).zip(&l.dequant).zip(&l.bias) {
                        *o = a as f32 * d + b;
                    }
                }
            }
        }
        Packed::F32(l) => {
            for ((o, row), &b) in y.iter_mut().zip(l.weight.chunks_exact(l.inp)).zip(&l.bias) {
                *o = dot_f32(row, x) + b;
            }
        }
    }
}

#[inline(always)]
fn forward(m: &Model, s: &mut Scratch, obs: &[f32]) -> usize {
    let nh = m.kind.hidden_layers();
    let Scratch { a, b, xq, acc, value, scores } = s;
    let (mut cur, mut next) = (a, b);
    cur[..obs.len()].copy_from_slice(obs);
    let mut width = obs.len();
    for layer in &m.layers[..nh] {
        let out = layer.out();
        dense(layer, m.gemv, &cur[..width], &mut next[..out], xq, acc);
        match m.kind {
            PolicyKind::Dqn => next[..out].iter_mut().for_each(|v| *v = relu(*v)),
            PolicyKind::Ppo => next[..out].iter_mut().for_each(|v| *v = tanh_rational(*v)),
        }
        std::mem::swap(&mut cur, &mut next);
        width = out;
    }
    let z = &cur[..width];
    if m.kind.dueling() {
        dense(&m.layers[nh], m.gemv, z, value, xq, acc);
        dense(&m.layers[nh + 1], m.gemv, z, scores, xq, acc);
        let mean = scores.iter().sum::<f32>() / m.n_actions as f32;
        for q in scores.iter_mut() {
            *q = (*q - mean) + value[0];
        }
    } else {
        dense(&m.layers[nh], m.gemv, z, scores, xq, acc);
    }
    first_argmax(scores)
}

/// [`forward`] compiled for AVX2 + FMA (FMA only lets the compiler use those registers:
/// Rust never fuses a multiply and an add on its own, so results equal the portable
/// build's).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn forward_avx2(m: &Model, s: &mut Scratch, obs: &[f32]) -> usize {
    forward(m, s, obs)
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// A quantised greedy policy on the CPU; see the module docs.
#[derive(Debug, Clone)]
pub struct Int8Policy {
    model: Model,
    scratch: Scratch,
    avx2: bool,
}

impl Int8Policy {
    /// A policy running `net` on the best ISA of this CPU.
    pub fn new(net: &QuantNet) -> Result<Self> {
        Self::with_isa(net, Isa::detect())
    }

    /// A policy running `net`'s INT8 products on `isa` (for tests and benchmarks); an ISA
    /// this CPU lacks is an error.
    pub fn with_isa(net: &QuantNet, isa: Isa) -> Result<Self> {
        net.check()?;
        let gemv = Gemv::new(isa)
            .ok_or_else(|| Error::invalid("ISA", format!("{} is not available on this CPU", isa.name())))?;
        let layers: Vec<Packed> = net
            .layers
            .iter()
            .map(|l| match l {
                QuantLayer::Int8(q) => Packed::Int8(PackedLinear::new(q, net.dynamic_inputs())),
                QuantLayer::F32(f) => Packed::F32(f.clone()),
            })
            .collect();
        let widest = net.layers.iter().map(|l| l.dims().0.max(l.dims().1)).max().unwrap_or(1);
        let widest_padded = crate::gemv_i8::padded(widest);
        let (state_dim, n_actions) = (net.state_dim(), net.n_actions());
        Ok(Self {
            model: Model { kind: net.kind, layers, gemv, state_dim, n_actions },
            scratch: Scratch {
                a: vec![0.0; widest],
                b: vec![0.0; widest],
                xq: vec![0; widest_padded],
                acc: vec![0; widest],
                value: [0.0],
                scores: vec![0.0; n_actions],
            },
            avx2: isa != Isa::Scalar && has_avx2_fma(),
        })
    }

    /// The ISA of the INT8 products.
    pub fn isa(&self) -> Isa {
        self.model.gemv.isa()
    }

    /// Which network.
    pub fn kind(&self) -> PolicyKind {
        self.model.kind
    }

    /// Input width.
    pub fn state_dim(&self) -> usize {
        self.model.state_dim
    }

    /// Number of actions.
    pub fn n_actions(&self) -> usize {
        self.model.n_actions
    }

    /// The greedy action for one observation (`state_dim` finite values); the scores
    /// (Q values or logits) stay readable through [`Int8Policy::scores`] until the next call.
    pub fn act(&mut self, obs: &[f32]) -> Result<usize> {
        const CTX: &str = "Int8Policy::act";
        if obs.len() != self.model.state_dim {
            return Err(Error::Length { what: "obs", expected: self.model.state_dim, got: obs.len(), context: CTX });
        }
        if let Some((index, value)) = first_non_finite(obs) {
            return Err(Error::NonFinite { what: "obs".into(), index, value: value as f64, context: CTX });
        }
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: `avx2` is set only when AVX2 and FMA were detected on this CPU.
            return Ok(unsafe { forward_avx2(&self.model, &mut self.scratch, obs) });
        }
        Ok(forward(&self.model, &mut self.scratch, obs))
    }

    /// The last call's scores (`n_actions`).
    pub fn scores(&self) -> &[f32] {
        &self.scratch.scores
    }

    /// Greedy actions for `obs` rows (`rows × state_dim` values) into `actions` (`rows`).
    pub fn act_batch(&mut self, obs: &[f32], actions: &mut [usize]) -> Result<()> {
        let d = self.model.state_dim;
        if obs.len() != actions.len() * d {
            return Err(Error::Length {
                what: "obs",
                expected: actions.len() * d,
                got: obs.len(),
                context: "Int8Policy::act_batch",
            });
        }
        for (row, a) in obs.chunks_exact(d).zip(actions.iter_mut()) {
            *a = self.act(row)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{agreement, reference_scores};
    use crate::testing::{random_net, uniforms};
    use crate::CalibMethod;
    use proptest::prelude::*;

    fn seed() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(11, |d| d.as_nanos() as u64)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        /// Fresh random networks (both kinds, odd widths, any layers kept F32, either
        /// calibration) and observations: every ISA's policy gives the reference's scores
        /// to the bit and its action.
        #[test]
        fn every_isa_matches_the_scalar_reference(
            dqn in any::<bool>(),
            state_dim in 1usize..90,
            h1 in 1usize..200,
            h2 in 1usize..140,
            n_actions in 2usize..6,
            keep in 0u8..8,
            method_pick in 0u8..3,
            net_seed in any::<u64>(),
            obs_scale in 0.01f32..20.0,
        ) {
            let kind = if dqn { PolicyKind::Dqn } else { PolicyKind::Ppo };
            let hidden: Vec<usize> = if dqn { vec![h1, h2, h2.div_ceil(2)] } else { vec![h1, h2] };
            let net = random_net(kind, state_dim, &hidden, n_actions, net_seed);
            let names = kind.layer_names();
            let keep_f32: Vec<&str> =
                names.iter().enumerate().filter(|(i, _)| keep & (1 << (i % 3)) != 0 && *i >= names.len() - 2).map(|(_, n)| *n).collect();
            let calib: Vec<f32> = uniforms(net_seed ^ 1, 3, 64 * state_dim).iter().map(|v| v * obs_scale).collect();
            let method = [CalibMethod::MinMax, CalibMethod::Percentile(99.0), CalibMethod::Dynamic][method_pick as usize];
            let q = crate::quantize(&net, &calib, method, &keep_f32).unwrap();
            // Fresh observations, wider than the calibration range so inputs also clip.
            let obs: Vec<f32> = uniforms(net_seed ^ 2, 4, 16 * state_dim).iter().map(|v| v * obs_scale * 1.5).collect();
            for isa in Isa::available() {
                let mut p = Int8Policy::with_isa(&q, isa).unwrap();
                for row in obs.chunks_exact(state_dim) {
                    let (want, want_a) = reference_scores(&q, row).unwrap();
                    let a = p.act(row).unwrap();
                    prop_assert_eq!(a, want_a, "{:?}", isa);
                    let same = p.scores().iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                    prop_assert!(same, "{:?}: {:?} vs {:?}", isa, p.scores(), want);
                }
                let mut acts = vec![usize::MAX; 16];
                p.act_batch(&obs, &mut acts).unwrap();
                prop_assert!(acts.iter().all(|&a| a < n_actions));
            }
        }
    }

    /// Default-sized networks quantised on their own input distribution stay close to F32:
    /// score errors are a small fraction of the scores' range, and greedy actions mostly
    /// agree (random networks have many near-ties; trained ones are checked by fx-train).
    #[test]
    fn quantised_scores_stay_close_to_f32() {
        let s = seed();
        for kind in [PolicyKind::Dqn, PolicyKind::Ppo] {
            let hidden: &[usize] = if kind.dueling() { &[256, 256, 128] } else { &[256, 256] };
            let net = random_net(kind, 56, hidden, 3, s);
            let calib: Vec<f32> = uniforms(s, 10, 1024 * 56).iter().map(|v| v * 2.0).collect();
            let test: Vec<f32> = uniforms(s, 11, 1024 * 56).iter().map(|v| v * 2.0).collect();
            let mut errors = Vec::new();
            for method in [CalibMethod::MinMax, CalibMethod::Percentile(99.99), CalibMethod::Dynamic] {
                let q = crate::quantize(&net, &calib, method, &[]).unwrap();
                let a = agreement(&net, &q, &test).unwrap();
                // Percentile calibration clips the widest inputs, so its worst case is looser.
                assert!(a.mean_abs_score_diff <= 0.02 * a.max_abs_score, "{kind:?} {method}: {a:?}");
                assert!(a.max_abs_score_diff <= 0.15 * a.max_abs_score, "{kind:?} {method}: {a:?}");
                assert!(a.fraction() >= 0.9, "{kind:?} {method}: {a:?}");
                errors.push(a.mean_abs_score_diff);
                let f32_bytes = 4 * net.num_params();
                assert!(f32_bytes as f64 / q.bytes() as f64 >= 3.5, "{kind:?}: {f32_bytes} vs {}", q.bytes());
            }
            // Dynamic scales never clip and give small inputs a finer step: on average no
            // worse than min-max on the same network.
            assert!(errors[2] <= errors[0] * 1.05, "{kind:?}: dynamic {} vs min-max {}", errors[2], errors[0]);
        }
    }

    #[test]
    fn bad_observations_are_one_line_errors() {
        let net = random_net(PolicyKind::Ppo, 5, &[8, 8], 3, 1);
        let q = crate::quantize(&net, &uniforms(1, 1, 50), CalibMethod::MinMax, &[]).unwrap();
        let mut p = Int8Policy::new(&q).unwrap();
        for (obs, want) in [
            (vec![0.0; 4], "expected 5 values, got 4"),
            (vec![0.0, 0.0, f32::NAN, 0.0, 0.0], "non-finite value NaN at index 2"),
            (vec![f32::INFINITY, 0.0, 0.0, 0.0, 0.0], "non-finite value inf at index 0"),
        ] {
            let e = p.act(&obs).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{e}");
            assert!(reference_scores(&q, &obs).is_err());
        }
        let mut acts = [0usize; 2];
        assert!(p.act_batch(&[0.0; 9], &mut acts).is_err());
        assert!(p.act(&[0.1, 0.2, 0.3, 0.4, 0.5]).unwrap() < 3);
    }
}
