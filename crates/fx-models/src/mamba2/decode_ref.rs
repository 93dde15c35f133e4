//! f64 CPU reference of `kernels/mamba2/mamba2_step.cu` (launched by `cuda::mamba2_step`): one MAMBA-2
//! recurrent decode step, a new bar `x [B, n_in]` through every layer's conv and SSM state to the
//! prediction `[B]`, with `Mamba2::step`'s math (fx-models tests it against that on the CPU):
//! `h = embed(x)`; per layer `u = rmsnorm(h)`, `z | xBC | dt = in_proj · u`, the causal conv over
//! the last `d_conv` xBC values + SiLU, `dt = softplus(dt + dt_bias)`, the SSD recurrence
//! `s = exp(dt·A)·s + (x·dt) ⊗ B`, `y = s · C + D·x` with `A = −exp(A_log)`, the gated RMSNorm
//! `rmsnorm(y ⊙ silu(z))` per group, `h += out_proj · y`; then `head(rmsnorm(h))`.
//!
//! Also the kernel's limits ([`StepDims::supported`]) and the shared memory of its launch
//! ([`StepDims::smem_floats`], the kernel's own layout), which the wrapper and the device tests
//! share. Layouts are the model's: weights row-major `[out, in]`, `conv_w [conv_dim, d_conv]`,
//! per layer conv state `[B, d_conv − 1, conv_dim]` (oldest first) and SSM state
//! `[B, nheads, headdim, d_state]`.

use crate::mamba2::ops_ref::{softplus, MAX_CONV};
use crate::mamba2::ssd_ref::need;
use fx_kernels::{Error, Result};

/// Blocks of the kernel's thread-block cluster, in the order the wrapper tries them: 16 (a
/// non-portable size, where the device allows it) then 8. Each block streams 1/C of the rows of
/// every weight matrix.
pub const CLUSTER_SIZES: [usize; 2] = [16, 8];
/// Most rows per launch (every block keeps every row's vectors in its shared memory).
pub const MAX_BATCH: usize = 8;
/// Most layers (the kernel's parameter block holds a fixed table of layer addresses).
pub const MAX_LAYERS: usize = 16;
/// Largest `d_state` (a warp holds an SSM state row in registers, 4 values a lane).
pub const MAX_STATE: usize = 128;

/// Sizes of one decode step. `eps` is the RMSNorms' epsilon (all three norms share it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDims {
    pub batch: usize,
    pub n_in: usize,
    pub d_model: usize,
    pub n_layer: usize,
    pub d_inner: usize,
    pub d_state: usize,
    pub headdim: usize,
    pub ngroups: usize,
    pub d_conv: usize,
    pub eps: f64,
}

impl StepDims {
    /// `d_inner / headdim`.
    pub fn nheads(&self) -> usize {
        self.d_inner / self.headdim
    }

    /// `d_inner + 2 · ngroups · d_state` (the conv's channels: x, B, C).
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.ngroups * self.d_state
    }

    /// Rows of `in_proj`: `z [d_inner] | xBC [conv_dim] | dt [nheads]`.
    pub fn in_proj_rows(&self) -> usize {
        self.d_inner + self.conv_dim() + self.nheads()
    }

    /// Elements of one layer's conv state `[B, d_conv − 1, conv_dim]`.
    pub fn conv_state_len(&self) -> usize {
        self.batch * (self.d_conv - 1) * self.conv_dim()
    }

    /// Elements of one layer's SSM state `[B, nheads, headdim, d_state]`.
    pub fn ssm_state_len(&self) -> usize {
        self.batch * self.d_inner * self.d_state
    }

    /// Consistent positive sizes (`headdim | d_inner`, `ngroups | nheads`), an
    /// [`Error::Config`] otherwise.
    pub fn check(&self, context: &'static str) -> Result<()> {
        let ok = [self.batch, self.n_in, self.d_model, self.n_layer, self.d_inner, self.d_state]
            .iter()
            .chain(&[self.headdim, self.ngroups, self.d_conv])
            .all(|&v| v > 0)
            && self.d_inner.is_multiple_of(self.headdim)
            && self.nheads().is_multiple_of(self.ngroups)
            && self.eps.is_finite()
            && self.eps >= 0.0;
        if ok {
            Ok(())
        } else {
            Err(Error::Config {
                context,
                message: format!(
                    "decode step sizes {self:?} (need positive sizes, headdim | d_inner, ngroups | nheads)"
                ),
            })
        }
    }

    /// [`StepDims::check`] and the kernel's limits: batch ≤ [`MAX_BATCH`], n_layer ≤
    /// [`MAX_LAYERS`], d_state ≤ [`MAX_STATE`], d_conv ≤ [`MAX_CONV`], and index arithmetic in 32
    /// bits; an [`Error::Unsupported`] beyond them (the caller falls back to candle's step).
    pub fn supported(&self, context: &'static str) -> Result<()> {
        self.check(context)?;
        let fits_u32 = [
            self.in_proj_rows() * self.d_model,
            self.d_model * self.d_inner.max(self.n_in),
            self.batch * self.in_proj_rows(),
            self.ssm_state_len(),
            self.conv_state_len(),
        ]
        .iter()
        .all(|&v| v < (1 << 31));
        let fits = self.batch <= MAX_BATCH
            && self.n_layer <= MAX_LAYERS
            && self.d_state <= MAX_STATE
            && self.d_conv <= MAX_CONV
            && fits_u32;
        if fits {
            Ok(())
        } else {
            Err(Error::Unsupported {
                context,
                message: format!(
                    "decode step sizes {self:?}: the fused kernel takes batch <= {MAX_BATCH}, n_layer <= \
                     {MAX_LAYERS}, d_state <= {MAX_STATE}, d_conv <= {MAX_CONV}"
                ),
            })
        }
    }

    /// Floats of the kernel's dynamic shared memory per block on a cluster of `blocks`, in its
    /// order (each piece rounded up to 4 floats): four bulk-copy barriers (8 floats), the
    /// residual `h [B, d_model]`, the GEMV input
    /// `u [B, max(d_model, n_in)]`, `zx [B, in_proj_rows]`, `yz [B, d_inner]`, a block's stage (its
    /// in_proj rows of every batch row or its SSM rows), the per-block partial sums
    /// `[blocks, B·ngroups]` and their roots `[B·ngroups]`; then a layer's staged parameters: the
    /// norm weight `[d_model]`, the block's rows' conv weights `[per_a, d_conv]`, bias `[per_a]`
    /// and state `[B, d_conv − 1, per_a]`, `dt_bias [nheads]`, every layer's `A_log` and `D`
    /// `[n_layer, nheads]` each, and the gated
    /// norm's weight `[d_inner]` (`per_a` = in_proj rows / blocks, rounded up); with `staged`
    /// weights then the block's out_proj rows `[per_o, d_inner]` (`per_o` = d_model / blocks,
    /// rounded up) and in_proj rows `[per_a, d_model]`, the embedding's weight
    /// `[d_model, n_in]`, norm_f's and the head's weights `[d_model]` each.
    pub fn smem_floats(&self, blocks: usize, staged: bool) -> usize {
        let r4 = |n: usize| n.div_ceil(4) * 4;
        let b = self.batch;
        let rows = self.in_proj_rows();
        let per_a = rows.div_ceil(blocks);
        let per_q = (b * self.d_inner).div_ceil(blocks);
        let pairs = b * self.ngroups;
        let k = self.d_conv;
        let dm = self.d_model;
        let weights = if staged {
            r4(dm.div_ceil(blocks) * self.d_inner) + r4(per_a * dm) + r4(dm * self.n_in) + 2 * r4(dm)
        } else {
            0
        };
        8 + r4(b * self.d_model)
            + r4(b * self.d_model.max(self.n_in))
            + r4(b * rows)
            + r4(b * self.d_inner)
            + r4((b * per_a).max(per_q))
            + r4(blocks * pairs)
            + r4(pairs)
            + r4(self.d_model)
            + r4(per_a * k)
            + r4(per_a)
            + r4(b * (k - 1) * per_a)
            + r4(self.nheads())
            + 2 * r4(self.n_layer * self.nheads())
            + r4(self.d_inner)
            + weights
    }
}

/// One layer's parameters (the model's layouts, see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct LayerParams<'a> {
    /// `layers.{i}.norm.weight [d_model]`.
    pub norm_w: &'a [f64],
    /// `[in_proj_rows, d_model]`.
    pub in_proj: &'a [f64],
    /// `[conv_dim, d_conv]`, `[conv_dim]`.
    pub conv_w: &'a [f64],
    pub conv_b: &'a [f64],
    /// `[nheads]` each.
    pub dt_bias: &'a [f64],
    pub a_log: &'a [f64],
    pub d: &'a [f64],
    /// The gated norm's weight `[d_inner]`.
    pub gnorm_w: &'a [f64],
    /// `[d_model, d_inner]`.
    pub out_proj: &'a [f64],
}

/// Every parameter of the step.
#[derive(Debug, Clone)]
pub struct StepParams<'a> {
    /// `[d_model, n_in]`, `[d_model]`.
    pub embed_w: &'a [f64],
    pub embed_b: &'a [f64],
    /// One per layer.
    pub layers: Vec<LayerParams<'a>>,
    /// `norm_f.weight [d_model]`, `head.weight [d_model]`, `head.bias [1]`.
    pub norm_f: &'a [f64],
    pub head_w: &'a [f64],
    pub head_b: &'a [f64],
}

/// Owned host copies of a step's parameters, in the order of [`StepParams`]: `globals` are
/// embed_w, embed_b, norm_f, head_w, head_b; each of `layers` the nine of [`LayerParams`] in
/// its order (norm_w, in_proj, conv_w, conv_b, dt_bias, a_log, d, gnorm_w, out_proj). What a
/// model's tensors or a test's random values become before [`HostStepParams::view`] lends them
/// to [`step`] or `mamba2_cpu::Mamba2CpuStep::new`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostStepParams {
    pub globals: Vec<Vec<f64>>,
    pub layers: Vec<Vec<Vec<f64>>>,
}

impl HostStepParams {
    /// The borrowed view the step functions take (short lists panic: build them whole).
    pub fn view(&self) -> StepParams<'_> {
        let g = &self.globals;
        StepParams {
            embed_w: &g[0],
            embed_b: &g[1],
            layers: self
                .layers
                .iter()
                .map(|l| LayerParams {
                    norm_w: &l[0],
                    in_proj: &l[1],
                    conv_w: &l[2],
                    conv_b: &l[3],
                    dt_bias: &l[4],
                    a_log: &l[5],
                    d: &l[6],
                    gnorm_w: &l[7],
                    out_proj: &l[8],
                })
                .collect(),
            norm_f: &g[2],
            head_w: &g[3],
            head_b: &g[4],
        }
    }
}

/// One layer's recurrent state: conv `[B, d_conv − 1, conv_dim]`, SSM `[B, nheads, headdim, d_state]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState {
    pub conv: Vec<f64>,
    pub ssm: Vec<f64>,
}

impl LayerState {
    /// A zero state for `d` (the state before the first bar).
    pub fn zeros(d: &StepDims) -> Self {
        Self { conv: vec![0.0; d.conv_state_len()], ssm: vec![0.0; d.ssm_state_len()] }
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `y[b, r] = Σ_k w[r, k] · x[b, k]` for `rows` rows of `cols`.
fn matvec(w: &[f64], x: &[f64], batch: usize, rows: usize, cols: usize) -> Vec<f64> {
    let mut y = vec![0.0; batch * rows];
    for b in 0..batch {
        let xb = &x[b * cols..(b + 1) * cols];
        for r in 0..rows {
            y[b * rows + r] = w[r * cols..(r + 1) * cols].iter().zip(xb).map(|(a, v)| a * v).sum();
        }
    }
    y
}

/// `x / sqrt(mean(x²) + eps) · w` over each row of `cols`.
fn rmsnorm(x: &[f64], w: &[f64], cols: usize, eps: f64) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for (row, o) in x.chunks(cols).zip(out.chunks_mut(cols)) {
        let q = (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(w) {
            *o = v / q * w;
        }
    }
    out
}

pub(crate) fn check_params(
    d: &StepDims,
    p: &StepParams<'_>,
    state: &[LayerState],
    x: &[f64],
    ctx: &'static str,
) -> Result<()> {
    d.check(ctx)?;
    if p.layers.len() != d.n_layer || state.len() != d.n_layer {
        return Err(Error::shape(
            "layers",
            ctx,
            format!("{} layers of parameters and state", d.n_layer),
            format!("{} and {}", p.layers.len(), state.len()),
        ));
    }
    let (dm, di, nh, cd) = (d.d_model, d.d_inner, d.nheads(), d.conv_dim());
    need(p.embed_w.len(), dm * d.n_in, "embed_w", ctx)?;
    need(p.embed_b.len(), dm, "embed_b", ctx)?;
    need(p.norm_f.len(), dm, "norm_f", ctx)?;
    need(p.head_w.len(), dm, "head_w", ctx)?;
    need(p.head_b.len(), 1, "head_b", ctx)?;
    need(x.len(), d.batch * d.n_in, "x", ctx)?;
    for (l, s) in p.layers.iter().zip(state) {
        need(l.norm_w.len(), dm, "norm_w", ctx)?;
        need(l.in_proj.len(), d.in_proj_rows() * dm, "in_proj", ctx)?;
        need(l.conv_w.len(), cd * d.d_conv, "conv_w", ctx)?;
        need(l.conv_b.len(), cd, "conv_b", ctx)?;
        need(l.dt_bias.len(), nh, "dt_bias", ctx)?;
        need(l.a_log.len(), nh, "a_log", ctx)?;
        need(l.d.len(), nh, "d", ctx)?;
        need(l.gnorm_w.len(), di, "gnorm_w", ctx)?;
        need(l.out_proj.len(), dm * di, "out_proj", ctx)?;
        need(s.conv.len(), d.conv_state_len(), "conv state", ctx)?;
        need(s.ssm.len(), d.ssm_state_len(), "ssm state", ctx)?;
    }
    Ok(())
}

/// One decode step: consumes `x [B, n_in]`, updates every layer's `state` in place and returns
/// the predictions `[B]`.
pub fn step(d: &StepDims, p: &StepParams<'_>, state: &mut [LayerState], x: &[f64]) -> Result<Vec<f64>> {
    const CTX: &str = "mamba2_step_ref::step";
    check_params(d, p, state, x, CTX)?;
    let (b, dm, di, n, ph, g, k) = (d.batch, d.d_model, d.d_inner, d.d_state, d.headdim, d.ngroups, d.d_conv);
    let (nh, cd, rows) = (d.nheads(), d.conv_dim(), d.in_proj_rows());
    let (gn, hpg, gs) = (g * n, nh / g, di / g);
    let mut h = matvec(p.embed_w, x, b, dm, d.n_in);
    for hb in h.chunks_mut(dm) {
        for (v, bias) in hb.iter_mut().zip(p.embed_b) {
            *v += bias;
        }
    }
    for (lp, st) in p.layers.iter().zip(state.iter_mut()) {
        let u = rmsnorm(&h, lp.norm_w, dm, d.eps);
        let zx = matvec(lp.in_proj, &u, b, rows, dm);
        let mut yz = vec![0.0; b * di];
        for bi in 0..b {
            let row = &zx[bi * rows..(bi + 1) * rows];
            let (z, xbc_raw, dt_raw) = (&row[..di], &row[di..di + cd], &row[di + cd..]);
            // Causal conv over (state rows 0 .. K−2, the new value), then the state shifts by one.
            let mut xbc = vec![0.0; cd];
            for c in 0..cd {
                let at = |j: usize| st.conv[(bi * (k - 1) + j) * cd + c];
                let window: Vec<f64> = (0..k - 1).map(at).chain([xbc_raw[c]]).collect();
                let s: f64 = window.iter().enumerate().map(|(j, v)| lp.conv_w[c * k + j] * v).sum();
                xbc[c] = silu(s + lp.conv_b[c]);
                for j in 0..k - 1 {
                    st.conv[(bi * (k - 1) + j) * cd + c] = window[j + 1];
                }
            }
            let (xs, bm, cm) = (&xbc[..di], &xbc[di..di + gn], &xbc[di + gn..]);
            let mut y = vec![0.0; di];
            for hh in 0..nh {
                let dt = softplus(dt_raw[hh] + lp.dt_bias[hh]);
                let decay = (dt * -lp.a_log[hh].exp()).exp();
                let gi = hh / hpg;
                let (bg, cg) = (&bm[gi * n..(gi + 1) * n], &cm[gi * n..(gi + 1) * n]);
                for pi in 0..ph {
                    let c = hh * ph + pi;
                    let s = &mut st.ssm[(bi * di + c) * n..(bi * di + c + 1) * n];
                    let mut acc = 0.0;
                    for ((sv, bv), cv) in s.iter_mut().zip(bg).zip(cg) {
                        *sv = *sv * decay + xs[c] * dt * bv;
                        acc += *sv * cv;
                    }
                    y[c] = acc + lp.d[hh] * xs[c];
                }
            }
            // Gated RMSNorm within each group of d_inner / ngroups channels.
            let gated: Vec<f64> = y.iter().zip(z).map(|(y, z)| y * silu(*z)).collect();
            for gi in 0..g {
                let part = &gated[gi * gs..(gi + 1) * gs];
                let q = (part.iter().map(|v| v * v).sum::<f64>() / gs as f64 + d.eps).sqrt();
                for (c, v) in part.iter().enumerate() {
                    yz[bi * di + gi * gs + c] = v / q * lp.gnorm_w[gi * gs + c];
                }
            }
        }
        let out = matvec(lp.out_proj, &yz, b, dm, di);
        for (hv, o) in h.iter_mut().zip(&out) {
            *hv += o;
        }
    }
    let u = rmsnorm(&h, p.norm_f, dm, d.eps);
    Ok(u.chunks(dm).map(|r| r.iter().zip(p.head_w).map(|(a, w)| a * w).sum::<f64>() + p.head_b[0]).collect())
}

/// Random models for the step's tests (the CPU step's and the kernel's): clock seeds, F32-
/// representable draws, parameters with the model's init ranges and a state.
#[cfg(test)]
pub(crate) mod testing {
    use super::{HostStepParams, LayerState, StepDims};
    use fx_kernels::rng;

    /// A seed from the clock, printed with the test's name.
    pub(crate) fn fresh_seed(test: &str) -> u64 {
        fx_hw::test_seed(test)
    }

    /// `n` F32-representable values in `[lo, hi)` (as f64), from stream `stream` of `seed`.
    pub(crate) fn uniform(n: usize, seed: u64, stream: u64, lo: f64, hi: f64) -> Vec<f64> {
        (0..n as u64).map(|i| f64::from((lo + (hi - lo) * rng::draw(seed, stream, 0, i)) as f32)).collect()
    }

    /// Parameters with the model's init ranges and a random state, every value
    /// F32-representable. Streams 1, 2, … of `seed` are drawn in order: the globals, then per
    /// layer its nine parameters, its conv state and its SSM state.
    pub(crate) fn random_model(d: &StepDims, seed: u64) -> (HostStepParams, Vec<LayerState>) {
        let (dm, di, nh, cd) = (d.d_model, d.d_inner, d.nheads(), d.conv_dim());
        let mut s = 0u64;
        let mut u = |n: usize, lo: f64, hi: f64| {
            s += 1;
            uniform(n, seed, s, lo, hi)
        };
        let a = |n: usize| 1.0 / (n as f64).sqrt();
        let f32s = |v: Vec<f64>, f: fn(f64) -> f32| v.into_iter().map(|x| f64::from(f(x))).collect::<Vec<_>>();
        let globals = vec![
            u(dm * d.n_in, -a(d.n_in), a(d.n_in)),
            u(dm, -a(d.n_in), a(d.n_in)),
            u(dm, 0.5, 1.5),
            u(dm, -a(dm), a(dm)),
            u(1, -0.1, 0.1),
        ];
        let (mut layers, mut states) = (Vec::new(), Vec::new());
        for _ in 0..d.n_layer {
            // dt log-uniform in [1e-3, 1e-1] stored as softplus⁻¹, A_log = ln U(1, 16) (the
            // model's init), both rounded to F32.
            let dt_bias = f32s(u(nh, 1e-3f64.ln(), 1e-1f64.ln()), |l| (l.exp().exp_m1()).ln() as f32);
            let a_log = f32s(u(nh, 1.0, 16.0), |v| (v as f32).ln());
            layers.push(vec![
                u(dm, 0.5, 1.5),
                u(d.in_proj_rows() * dm, -a(dm), a(dm)),
                u(cd * d.d_conv, -a(d.d_conv), a(d.d_conv)),
                u(cd, -a(d.d_conv), a(d.d_conv)),
                dt_bias,
                a_log,
                u(nh, 0.5, 1.5),
                u(di, 0.5, 1.5),
                u(dm * di, -a(di), a(di)),
            ]);
            states.push(LayerState { conv: u(d.conv_state_len(), -1.0, 1.0), ssm: u(d.ssm_state_len(), -0.5, 0.5) });
        }
        (HostStepParams { globals, layers }, states)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default_dims(batch: usize) -> StepDims {
        StepDims {
            batch,
            n_in: 51,
            d_model: 256,
            n_layer: 4,
            d_inner: 512,
            d_state: 64,
            headdim: 64,
            ngroups: 1,
            d_conv: 4,
            eps: 1e-5,
        }
    }

    #[test]
    fn sizes_limits_and_shared_memory() {
        let d = default_dims(1);
        assert_eq!((d.nheads(), d.conv_dim(), d.in_proj_rows()), (8, 640, 1160));
        // h 256 + u 256 + zx 1160 + yz 512 + stage max(145, 64) → 148 + ss 8 + sq 1 → 4, then
        // norm 256 + conv weights 145·4 + bias 145 → 148 + state 3·145 → 436 + dt_bias 8 + A_log
        // and D 2·4·8 + gnorm 512.
        assert_eq!(
            d.smem_floats(8, false),
            8 + 256 + 256 + 1160 + 512 + 148 + 8 + 4 + 256 + 580 + 148 + 436 + 72 + 512
        );
        // 16 blocks: stage max(73, 32) → 76, ss 16, conv weights 292, bias 76, state 219 → 220.
        assert_eq!(
            d.smem_floats(16, false),
            8 + 256 + 256 + 1160 + 512 + 76 + 16 + 4 + 256 + 292 + 76 + 220 + 72 + 512
        );
        assert!(d.supported("t").is_ok());
        // Batch 8 at the default size stays well inside Hopper's 227 KiB per block.
        assert!(default_dims(8).smem_floats(8, false) * 4 < 100 * 1024);
        // Staged at 16 blocks: + out_proj 16·512 + in_proj 73·256 + embed 256·51 + 2·256, inside
        // Hopper's 227 KiB.
        let staged = d.smem_floats(16, true);
        assert_eq!(staged, d.smem_floats(16, false) + 8192 + 18688 + 13056 + 512);
        assert!(staged * 4 < 227 * 1024);
        for bad in [
            StepDims { batch: 9, ..d },
            StepDims { n_layer: 17, ..d },
            StepDims { d_state: 256, ..d },
            StepDims { d_conv: 9, ..d },
        ] {
            assert!(matches!(bad.supported("t"), Err(Error::Unsupported { .. })), "{bad:?}");
        }
        for bad in [StepDims { headdim: 48, ..d }, StepDims { ngroups: 3, ..d }, StepDims { batch: 0, ..d }] {
            assert!(matches!(bad.supported("t"), Err(Error::Config { .. })), "{bad:?}");
        }
    }

    /// One layer with `d_model = d_inner = headdim = d_state = 1`, `d_conv = 2`, by hand.
    #[test]
    fn scalar_model_by_hand() {
        let d = StepDims {
            batch: 1,
            n_in: 1,
            d_model: 1,
            n_layer: 1,
            d_inner: 1,
            d_state: 1,
            headdim: 1,
            ngroups: 1,
            d_conv: 2,
            eps: 0.0,
        };
        // in_proj rows: z, x, B, C, dt.
        let in_proj = [0.5, 2.0, -1.0, 3.0, 0.25];
        let (conv_w, conv_b) = ([0.3, 0.7, 0.1, 0.2, -0.4, 0.6], [0.05, -0.1, 0.2]);
        let one = [1.0];
        let lp = LayerParams {
            norm_w: &one,
            in_proj: &in_proj,
            conv_w: &conv_w,
            conv_b: &conv_b,
            dt_bias: &[-2.0],
            a_log: &[0.5],
            d: &[0.8],
            gnorm_w: &[1.5],
            out_proj: &[0.9],
        };
        let p = StepParams {
            embed_w: &[2.0],
            embed_b: &[-0.5],
            layers: vec![lp],
            norm_f: &[1.0],
            head_w: &[0.7],
            head_b: &[0.1],
        };
        let mut st = vec![LayerState { conv: vec![0.4, -0.2, 0.6], ssm: vec![0.3] }];
        let got = step(&d, &p, &mut st, &[0.75]).unwrap();
        // h = 1; rmsnorm(1) = 1 (eps 0), so in_proj's outputs are its weights.
        let h = 2.0 * 0.75 - 0.5;
        let sig = |v: f64| v / (1.0 + (-v).exp());
        let conv = |c: usize, state: f64, new: f64| sig(conv_w[2 * c] * state + conv_w[2 * c + 1] * new + conv_b[c]);
        let (xv, bv, cv) = (conv(0, 0.4, 2.0), conv(1, -0.2, -1.0), conv(2, 0.6, 3.0));
        let dt = softplus(0.25 - 2.0);
        let s = 0.3 * (-dt * 0.5f64.exp()).exp() + xv * dt * bv;
        let y = (s * cv + 0.8 * xv) * sig(0.5);
        let gated = y / (y * y).sqrt() * 1.5;
        let h2 = h + 0.9 * gated;
        let want = h2 / (h2 * h2).sqrt() * 0.7 + 0.1;
        assert!((got[0] - want).abs() < 1e-12, "{} vs {want}", got[0]);
        assert_eq!(st[0].conv, vec![2.0, -1.0, 3.0]);
        assert!((st[0].ssm[0] - s).abs() < 1e-15);
    }

    #[test]
    fn short_buffers_are_refused() {
        let d = StepDims {
            batch: 2,
            n_in: 3,
            d_model: 4,
            n_layer: 1,
            d_inner: 8,
            d_state: 2,
            headdim: 4,
            ngroups: 1,
            d_conv: 2,
            eps: 1e-5,
        };
        let z = vec![0.0; 1000];
        let lp = LayerParams {
            norm_w: &z,
            in_proj: &z,
            conv_w: &z,
            conv_b: &z,
            dt_bias: &z,
            a_log: &z,
            d: &z,
            gnorm_w: &z,
            out_proj: &z,
        };
        let p = StepParams { embed_w: &z, embed_b: &z, layers: vec![lp], norm_f: &z, head_w: &z, head_b: &z };
        let mut st = vec![LayerState::zeros(&d)];
        assert_eq!(step(&d, &p, &mut st, &z[..6]).unwrap().len(), 2);
        assert!(step(&d, &p, &mut st, &z[..5]).is_err());
        st[0].ssm.pop();
        assert!(step(&d, &p, &mut st, &z[..6]).is_err());
    }
}
