//! [`Mamba2CpuStep`]: MAMBA-2's recurrent one-bar step on the CPU, for a trading loop that feeds
//! a forecaster one bar at a time. The weights are copied once into plain `Vec<f32>`s and the
//! model's conv and SSM state live beside them; a step is GEMVs (the shared F32 dot product of
//! `cpu_dot`, AVX2 + FMA where the CPU has them) and short loops on the calling thread — no
//! thread pool, no tensor, no allocation. It computes what
//! [`crate::mamba2::decode_ref::step`] computes (f64), at batch 1, and is tested against it; the
//! GPU twin is `cuda::mamba2_step`.
//!
//! Each layer's `in_proj` and `out_proj` (some 90 % of the bytes a bar reads) sit behind the
//! [`Projection`] trait: F32 rows here ([`Mamba2CpuStep::new`]); `fx-quant` plugs in INT8
//! rows through [`Mamba2CpuStep::with_projections`].

use crate::cpu_dot::pick_dot;
use crate::mamba2::decode_ref::{LayerState, StepDims, StepParams};
use fx_kernels::{Error, Result};

/// Which of a layer's two projections a [`Projection`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionKind {
    /// `[in_proj_rows, d_model]`: the normed residual to `z | xBC | dt`.
    In,
    /// `[d_model, d_inner]`: the gated SSD output back to the residual.
    Out,
}

/// A layer's projection `out[r] = Σ_i W[r, i] · x[i]` (`x` of its `cols`, `out` of its rows),
/// computed on the calling thread without allocating.
pub trait Projection: Send + std::fmt::Debug {
    /// `out = W x`.
    fn apply(&mut self, x: &[f32], out: &mut [f32]);
    /// The bytes of its weights (for reports).
    fn bytes(&self) -> usize;
    /// A copy (the step is `Clone`).
    fn clone_box(&self) -> Box<dyn Projection>;
}

/// F32 weight rows and the shared dot product (the default projection).
#[derive(Debug, Clone)]
pub struct F32Rows {
    w: Vec<f32>,
    cols: usize,
    dot: fn(&[f32], &[f32]) -> f32,
}

impl F32Rows {
    /// `w`: `rows × cols`, row-major.
    pub fn new(w: Vec<f32>, cols: usize) -> Self {
        Self { w, cols, dot: pick_dot() }
    }
}

impl Projection for F32Rows {
    fn apply(&mut self, x: &[f32], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(self.w.chunks_exact(self.cols)) {
            *o = (self.dot)(row, &x[..self.cols]);
        }
    }
    fn bytes(&self) -> usize {
        self.w.len() * 4
    }
    fn clone_box(&self) -> Box<dyn Projection> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn Projection> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// One layer's weights (the model's layouts, F32, the projections behind [`Projection`]).
#[derive(Debug, Clone)]
struct Layer {
    norm_w: Vec<f32>,
    in_proj: Box<dyn Projection>,
    conv_w: Vec<f32>,
    conv_b: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `−exp(A_log)`, computed once (the step's decay is `exp(dt · a)`).
    a: Vec<f32>,
    d: Vec<f32>,
    gnorm_w: Vec<f32>,
    out_proj: Box<dyn Projection>,
    /// `[d_conv − 1, conv_dim]`, oldest first.
    conv_state: Vec<f32>,
    /// `[nheads, headdim, d_state]`.
    ssm_state: Vec<f32>,
}

/// A MAMBA-2 forecaster stepped one bar at a time on the CPU (batch 1; see the module docs).
#[derive(Debug, Clone)]
pub struct Mamba2CpuStep {
    dims: StepDims,
    embed_w: Vec<f32>,
    embed_b: Vec<f32>,
    layers: Vec<Layer>,
    norm_f: Vec<f32>,
    head_w: Vec<f32>,
    head_b: f32,
    /// Scratch: the residual stream `[d_model]`, the GEMV input, `z | xBC | dt` and the gated
    /// SSD output `[d_inner]`.
    h: Vec<f32>,
    u: Vec<f32>,
    zx: Vec<f32>,
    yz: Vec<f32>,
    /// `out_proj`'s output `[d_model]`, added to the residual.
    po: Vec<f32>,
    dot: fn(&[f32], &[f32]) -> f32,
}

/// Builds a layer's projection from its F32 weights: `(kind, layer, rows, cols, w)`.
pub type MakeProjection<'a> =
    dyn FnMut(ProjectionKind, usize, usize, usize, Vec<f32>) -> Result<Box<dyn Projection>> + 'a;

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `u = h / sqrt(mean(h²) + eps) · w`.
fn rmsnorm(h: &[f32], w: &[f32], eps: f32, u: &mut [f32]) {
    let q = (h.iter().map(|v| v * v).sum::<f32>() / h.len() as f32 + eps).sqrt();
    for ((o, v), w) in u.iter_mut().zip(h).zip(w) {
        *o = v / q * w;
    }
}

impl Mamba2CpuStep {
    /// Copies `p` (checked against `dims`, batch 1) and starts from a zero state. Values that
    /// came from F32 weights convert back exactly.
    pub fn new(dims: &StepDims, p: &StepParams<'_>) -> Result<Self> {
        Self::with_projections(dims, p, &mut |_, _, _, cols, w| Ok(Box::new(F32Rows::new(w, cols))))
    }

    /// [`Mamba2CpuStep::new`] with each layer's `in_proj` and `out_proj` built by `make`
    /// from their F32 weights (INT8 rows in `fx-quant`; a projection must compute `W x` for
    /// the rows and columns it is given).
    pub fn with_projections(dims: &StepDims, p: &StepParams<'_>, make: &mut MakeProjection<'_>) -> Result<Self> {
        const CTX: &str = "Mamba2CpuStep::new";
        if dims.batch != 1 {
            return Err(Error::Unsupported {
                context: CTX,
                message: format!("batch {}: it steps one row", dims.batch),
            });
        }
        // The reference's own checks of every length, with a zero state and bar.
        let zero: Vec<LayerState> = (0..dims.n_layer).map(|_| LayerState::zeros(dims)).collect();
        crate::mamba2::decode_ref::check_params(dims, p, &zero, &vec![0.0; dims.n_in], CTX)?;
        let layers = p
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(Layer {
                    norm_w: f32s(l.norm_w),
                    in_proj: make(ProjectionKind::In, i, dims.in_proj_rows(), dims.d_model, f32s(l.in_proj))?,
                    conv_w: f32s(l.conv_w),
                    conv_b: f32s(l.conv_b),
                    dt_bias: f32s(l.dt_bias),
                    a: l.a_log.iter().map(|&v| -(v as f32).exp()).collect(),
                    d: f32s(l.d),
                    gnorm_w: f32s(l.gnorm_w),
                    out_proj: make(ProjectionKind::Out, i, dims.d_model, dims.d_inner, f32s(l.out_proj))?,
                    conv_state: vec![0.0; dims.conv_state_len()],
                    ssm_state: vec![0.0; dims.ssm_state_len()],
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dims: *dims,
            embed_w: f32s(p.embed_w),
            embed_b: f32s(p.embed_b),
            layers,
            norm_f: f32s(p.norm_f),
            head_w: f32s(p.head_w),
            head_b: p.head_b[0] as f32,
            h: vec![0.0; dims.d_model],
            u: vec![0.0; dims.d_model.max(dims.n_in)],
            zx: vec![0.0; dims.in_proj_rows()],
            yz: vec![0.0; dims.d_inner],
            po: vec![0.0; dims.d_model],
            dot: pick_dot(),
        })
    }

    /// The bytes of every layer's `in_proj` and `out_proj` weights (as their projections
    /// hold them).
    pub fn projection_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.in_proj.bytes() + l.out_proj.bytes()).sum()
    }

    /// The sizes it steps.
    pub fn dims(&self) -> &StepDims {
        &self.dims
    }

    /// Back to the zero state (before the first bar).
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            l.conv_state.fill(0.0);
            l.ssm_state.fill(0.0);
        }
    }

    /// Replaces the recurrent state, e.g. with the state after a history (the model's
    /// `forward_with_state`), one [`LayerState`] per layer in the reference's layouts.
    pub fn set_state(&mut self, state: &[LayerState]) -> Result<()> {
        const CTX: &str = "Mamba2CpuStep::set_state";
        if state.len() != self.layers.len() {
            return Err(Error::shape("state", CTX, self.layers.len(), state.len()));
        }
        for (l, s) in self.layers.iter().zip(state) {
            if s.conv.len() != l.conv_state.len() || s.ssm.len() != l.ssm_state.len() {
                return Err(Error::shape(
                    "state",
                    CTX,
                    format!("conv {} and ssm {} values a layer", l.conv_state.len(), l.ssm_state.len()),
                    format!("conv {} and ssm {}", s.conv.len(), s.ssm.len()),
                ));
            }
            if let Some((index, &value)) = s.conv.iter().chain(&s.ssm).enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(Error::NonFinite { what: "state", index, value, context: CTX });
            }
        }
        for (l, s) in self.layers.iter_mut().zip(state) {
            l.conv_state.iter_mut().zip(&s.conv).for_each(|(o, v)| *o = *v as f32);
            l.ssm_state.iter_mut().zip(&s.ssm).for_each(|(o, v)| *o = *v as f32);
        }
        Ok(())
    }

    /// The current state in the reference's layouts (f64 copies; allocates).
    pub fn state(&self) -> Vec<LayerState> {
        let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect();
        self.layers.iter().map(|l| LayerState { conv: f64s(&l.conv_state), ssm: f64s(&l.ssm_state) }).collect()
    }

    /// One bar `x [n_in]` (finite values) through every layer: updates the state and returns
    /// the prediction. A wrong length or a non-finite value is an error and leaves the state
    /// as it was.
    pub fn step(&mut self, x: &[f32]) -> Result<f32> {
        const CTX: &str = "Mamba2CpuStep::step";
        let d = self.dims;
        if x.len() != d.n_in {
            return Err(Error::shape("x", CTX, d.n_in, x.len()));
        }
        if let Some(index) = x.iter().position(|v| !v.is_finite()) {
            return Err(Error::NonFinite { what: "x", index, value: f64::from(x[index]), context: CTX });
        }
        let (dm, di, n, ph, g, k) = (d.d_model, d.d_inner, d.d_state, d.headdim, d.ngroups, d.d_conv);
        let (nh, cd, rows) = (d.nheads(), d.conv_dim(), d.in_proj_rows());
        let (gn, hpg, gs, eps) = (g * n, nh / g, di / g, d.eps as f32);
        let dot = self.dot;
        for (r, hv) in self.h.iter_mut().enumerate() {
            *hv = dot(&self.embed_w[r * d.n_in..(r + 1) * d.n_in], x) + self.embed_b[r];
        }
        for l in &mut self.layers {
            rmsnorm(&self.h, &l.norm_w, eps, &mut self.u[..dm]);
            l.in_proj.apply(&self.u[..dm], &mut self.zx[..rows]);
            // Causal conv over (state rows 0 .. K−2, the new value) + SiLU, in place over xBC;
            // the state shifts by one.
            let (z, rest) = self.zx.split_at_mut(di);
            let (xbc, dt_raw) = rest.split_at_mut(cd);
            for (c, v) in xbc.iter_mut().enumerate() {
                let w = &l.conv_w[c * k..(c + 1) * k];
                let mut s = 0.0f32;
                for j in 0..k - 1 {
                    s += w[j] * l.conv_state[j * cd + c];
                }
                s += w[k - 1] * *v;
                for j in 0..k.saturating_sub(2) {
                    l.conv_state[j * cd + c] = l.conv_state[(j + 1) * cd + c];
                }
                if k > 1 {
                    l.conv_state[(k - 2) * cd + c] = *v;
                }
                *v = silu(s + l.conv_b[c]);
            }
            let (xs, bc) = xbc.split_at(di);
            let (bm, cm) = bc.split_at(gn);
            for hh in 0..nh {
                let dt = softplus(dt_raw[hh] + l.dt_bias[hh]);
                let decay = (dt * l.a[hh]).exp();
                let gi = hh / hpg;
                let (bg, cg) = (&bm[gi * n..(gi + 1) * n], &cm[gi * n..(gi + 1) * n]);
                for pi in 0..ph {
                    let c = hh * ph + pi;
                    let xdt = xs[c] * dt;
                    let s = &mut l.ssm_state[c * n..(c + 1) * n];
                    for (sv, bv) in s.iter_mut().zip(bg) {
                        *sv = *sv * decay + xdt * bv;
                    }
                    let y = dot(s, cg) + l.d[hh] * xs[c];
                    self.yz[c] = y * silu(z[c]);
                }
            }
            // Gated RMSNorm within each group of d_inner / ngroups channels.
            for gi in 0..g {
                let part = &mut self.yz[gi * gs..(gi + 1) * gs];
                let q = (part.iter().map(|v| v * v).sum::<f32>() / gs as f32 + eps).sqrt();
                for (v, w) in part.iter_mut().zip(&l.gnorm_w[gi * gs..(gi + 1) * gs]) {
                    *v = *v / q * w;
                }
            }
            l.out_proj.apply(&self.yz, &mut self.po);
            for (hv, p) in self.h.iter_mut().zip(&self.po) {
                *hv += p;
            }
        }
        rmsnorm(&self.h, &self.norm_f, eps, &mut self.u[..dm]);
        Ok(dot(&self.u[..dm], &self.head_w) + self.head_b)
    }
}

#[cfg(test)]
mod tests {
    //! Against the f64 reference on fresh random parameters, states and bars (the seed is
    //! printed), over several steps and shapes; refusals.
    use super::*;
    use crate::mamba2::decode_ref::step;
    use crate::mamba2::decode_ref::testing::{fresh_seed, random_model, uniform};

    fn dims(n_in: usize, d_model: usize, n_layer: usize, d_inner: usize, d_state: usize, headdim: usize) -> StepDims {
        StepDims { batch: 1, n_in, d_model, n_layer, d_inner, d_state, headdim, ngroups: 1, d_conv: 4, eps: 1e-5 }
    }

    fn close(what: &str, got: f64, want: f64, tol: f64) {
        let err = (got - want).abs() / want.abs().max(1.0);
        assert!(got.is_finite() && err <= tol, "{what}: got {got}, want {want}, error {err:.2e} > {tol:.0e}");
    }

    #[test]
    fn steps_match_the_f64_reference() {
        const T: &str = "steps_match_the_f64_reference";
        let seed = fresh_seed(T);
        let cases = [
            dims(51, 256, 4, 512, 64, 64),
            // 3 groups, d_state 33 (not a multiple of the dot's lanes), d_conv 2
            StepDims { ngroups: 3, d_conv: 2, ..dims(7, 24, 2, 48, 33, 8) },
            // d_conv 1: no conv state
            StepDims { d_conv: 1, ..dims(5, 12, 3, 24, 8, 4) },
        ];
        for (ci, d) in cases.into_iter().enumerate() {
            // Start from a random state, as after a history.
            let (w, mut st) = random_model(&d, seed.wrapping_add(ci as u64));
            let p = w.view();
            let mut fast = Mamba2CpuStep::new(&d, &p).unwrap();
            fast.set_state(&st).unwrap();
            for s in 0..5u64 {
                let x = uniform(d.n_in, seed, 1000 + s, -2.0, 2.0);
                let want = step(&d, &p, &mut st, &x).unwrap()[0];
                let got = fast.step(&x.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap();
                close(&format!("case {ci} step {s} prediction"), f64::from(got), want, 1e-4);
            }
            for (l, (a, b)) in fast.state().iter().zip(&st).enumerate() {
                for (kind, x, y) in [("conv", &a.conv, &b.conv), ("ssm", &a.ssm, &b.ssm)] {
                    for (i, (u, v)) in x.iter().zip(y).enumerate() {
                        close(&format!("case {ci} layer {l} {kind} state [{i}]"), *u, *v, 1e-4);
                    }
                }
            }
        }
    }

    #[test]
    fn reset_and_refusals() {
        let d = StepDims { d_conv: 2, ..dims(5, 12, 2, 24, 8, 4) };
        let (w, _) = random_model(&d, 7);
        let p = w.view();
        assert!(matches!(Mamba2CpuStep::new(&StepDims { batch: 2, ..d }, &p), Err(Error::Unsupported { .. })));
        let mut m = Mamba2CpuStep::new(&d, &p).unwrap();
        let x = [0.5f32, -1.0, 0.25, 2.0, -0.75];
        let first = m.step(&x).unwrap();
        let second = m.step(&x).unwrap();
        assert_ne!(first, second, "the state carries over");
        m.reset();
        assert_eq!(m.step(&x).unwrap(), first, "reset is the zero state again");
        let before = m.state();
        assert!(m.step(&x[..4]).is_err(), "a short bar");
        assert!(m.step(&[0.0, f32::NAN, 0.0, 0.0, 0.0]).is_err(), "a NaN");
        assert_eq!(m.state(), before, "a refused bar leaves the state as it was");
        assert!(m.set_state(&before[..1]).is_err(), "one layer's state for two");
    }
}
