//! f64 CPU references of the MAMBA-2 training-step kernels of `kernels/mamba2/mamba2.cu` (launched
//! through `cuda::mamba2`) and of the cuBLAS calls around them: RMSNorm forward/backward, the
//! causal depthwise conv + SiLU with `dt = softplus(dt_raw + dt_bias)` and its backward, the
//! gated RMSNorm forward/backward, the `norm_f` + head + MSE forward and the loss reduction,
//! a row-major GEMM with `Blas::run`'s conventions and column sums. Each function mirrors its
//! kernel's arguments and buffer layouts (row-major, rows `r = b·len + t`), including the
//! per-block partial sums that a second pass (column sums) reduces, so the device tests
//! compare kernel and reference element for element, and the fused step's orchestration can
//! run on these functions on the CPU.

use crate::mamba2::ssd_ref::need;
use fx_kernels::{Error, Result};

/// Rows per block of the norm backward kernels: their weight-gradient partial sums are one
/// row of `cols` per block of this many rows.
pub const ROWS_PER_BLOCK: usize = 32;
/// Steps per thread of the conv backward: its weight-gradient partial sums are one row per
/// (batch row, tile of this many steps).
pub const CONV_TILE: usize = 32;
/// Widest causal conv the kernels take (its window lives in registers).
pub const MAX_CONV: usize = 8;
/// Widest row of the norm backward kernels (8 warps × this many F32 partial sums in 48 KiB of
/// shared memory).
pub const MAX_NORM_COLS: usize = 1536;

/// Partial-sum rows of a norm backward over `rows` rows.
pub fn row_blocks(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_BLOCK)
}

/// Conv-backward tiles per sequence of `len` steps.
pub fn conv_tiles(len: usize) -> usize {
    len.div_ceil(CONV_TILE)
}

/// A row-major GEMM `C[m, n] = op(A) op(B) + beta · C` with `Blas::run`'s conventions: `A`
/// stored `[k, m]` when `ta` (else `[m, k]`), `B` stored `[n, k]` when `tb` (else `[k, n]`),
/// `lda`/`ldb`/`ldc` the stored row strides; `beta = 0` does not read `C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmShape {
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub beta: f64,
}

/// [`GemmShape`] on slices starting at each matrix's first element.
pub fn gemm(g: &GemmShape, a: &[f64], b: &[f64], c: &mut [f64]) -> Result<()> {
    const CTX: &str = "mamba2_ref::gemm";
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let (ar, ac) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
    if g.lda < ac || g.ldb < bc || g.ldc < g.n {
        return Err(Error::shape("ld", CTX, "row strides >= the stored widths", format!("{g:?}")));
    }
    if g.k > 0 {
        need(a.len(), (ar - 1) * g.lda + ac, "a", CTX)?;
        need(b.len(), (br - 1) * g.ldb + bc, "b", CTX)?;
    }
    need(c.len(), (g.m - 1) * g.ldc + g.n, "c", CTX)?;
    for i in 0..g.m {
        for j in 0..g.n {
            let mut s = 0.0;
            for kk in 0..g.k {
                let av = if g.ta { a[kk * g.lda + i] } else { a[i * g.lda + kk] };
                let bv = if g.tb { b[j * g.ldb + kk] } else { b[kk * g.ldb + j] };
                s += av * bv;
            }
            let old = if g.beta == 0.0 { 0.0 } else { g.beta * c[i * g.ldc + j] };
            c[i * g.ldc + j] = s + old;
        }
    }
    Ok(())
}

/// `y[c] = Σ_r a[r·lda + c]` (the second pass of every partial-sum reduction).
pub fn col_sums(rows: usize, cols: usize, a: &[f64], lda: usize, y: &mut [f64]) -> Result<()> {
    const CTX: &str = "mamba2_ref::col_sums";
    if rows > 0 {
        need(a.len(), (rows - 1) * lda + cols, "a", CTX)?;
    }
    need(y.len(), cols, "y", CTX)?;
    for (c, out) in y[..cols].iter_mut().enumerate() {
        *out = (0..rows).map(|r| a[r * lda + c]).sum();
    }
    Ok(())
}

/// RMSNorm forward over rows of `h [rows, cols]`: with `bias`, first `h += bias` in place (the
/// embedding's bias, folded into the first layer's norm); `copy` receives `h` (the residual
/// stream's next buffer, which the layer's `out_proj` then accumulates onto);
/// `rstd = 1 / sqrt(mean(h²) + eps)`, `u = h · rstd · w`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_fwd(
    h: &mut [f64],
    bias: Option<&[f64]>,
    w: &[f64],
    mut copy: Option<&mut [f64]>,
    u: &mut [f64],
    rstd: &mut [f64],
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<()> {
    const CTX: &str = "mamba2_ref::rmsnorm_fwd";
    let n = rows * cols;
    need(h.len(), n, "h", CTX)?;
    need(w.len(), cols, "w", CTX)?;
    need(u.len(), n, "u", CTX)?;
    need(rstd.len(), rows, "rstd", CTX)?;
    if let Some(b) = bias {
        need(b.len(), cols, "bias", CTX)?;
    }
    if let Some(c) = &copy {
        need(c.len(), n, "copy", CTX)?;
    }
    for r in 0..rows {
        let row = &mut h[r * cols..(r + 1) * cols];
        if let Some(b) = bias {
            row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        if let Some(c) = copy.as_deref_mut() {
            c[r * cols..(r + 1) * cols].copy_from_slice(row);
        }
        let ms = row.iter().map(|x| x * x).sum::<f64>() / cols as f64;
        let rs = 1.0 / (ms + eps).sqrt();
        rstd[r] = rs;
        for (c, x) in row.iter().enumerate() {
            u[r * cols + c] = x * rs * w[c];
        }
    }
    Ok(())
}

/// The upstream gradient of a norm's output rows: a full matrix, or the outer product
/// `scale[r] · vec[c]` (the head: `d u_f = d pred ⊗ head.weight`).
#[derive(Debug, Clone, Copy)]
pub enum RowGrad<'a> {
    /// `du [rows, cols]`.
    Full(&'a [f64]),
    /// `du[r, c] = scale[r] · vec[c]`.
    Outer {
        /// `[rows]`.
        scale: &'a [f64],
        /// `[cols]`.
        vec: &'a [f64],
    },
}

impl RowGrad<'_> {
    fn at(&self, r: usize, c: usize, cols: usize) -> f64 {
        match self {
            RowGrad::Full(d) => d[r * cols + c],
            RowGrad::Outer { scale, vec } => scale[r] * vec[c],
        }
    }

    fn check(&self, rows: usize, cols: usize, context: &'static str) -> Result<()> {
        match self {
            RowGrad::Full(d) => need(d.len(), rows * cols, "du", context),
            RowGrad::Outer { scale, vec } => {
                need(scale.len(), rows, "du scale", context)?;
                need(vec.len(), cols, "du vec", context)
            }
        }
    }
}

/// RMSNorm backward: with `n = h · rstd` and `g = du ⊙ w`,
/// `dh (+)= rstd · (g − n · mean(g ⊙ n))` (added to `dh` when `accumulate`: the residual
/// stream's gradient) and `partials[blk, c] = Σ_{r in block blk} du[r, c] · n[r, c]` over
/// blocks of [`ROWS_PER_BLOCK`] rows (the weight gradient's first pass).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    du: RowGrad,
    h: &[f64],
    rstd: &[f64],
    w: &[f64],
    rows: usize,
    cols: usize,
    accumulate: bool,
    dh: &mut [f64],
    partials: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::rmsnorm_bwd";
    du.check(rows, cols, CTX)?;
    need(h.len(), rows * cols, "h", CTX)?;
    need(rstd.len(), rows, "rstd", CTX)?;
    need(w.len(), cols, "w", CTX)?;
    need(dh.len(), rows * cols, "dh", CTX)?;
    need(partials.len(), row_blocks(rows) * cols, "partials", CTX)?;
    partials[..row_blocks(rows) * cols].fill(0.0);
    for r in 0..rows {
        let rs = rstd[r];
        let s = (0..cols).map(|c| du.at(r, c, cols) * w[c] * h[r * cols + c] * rs).sum::<f64>() / cols as f64;
        for c in 0..cols {
            let d = du.at(r, c, cols);
            let n = h[r * cols + c] * rs;
            let v = rs * (d * w[c] - n * s);
            dh[r * cols + c] = if accumulate { dh[r * cols + c] + v } else { v };
            partials[(r / ROWS_PER_BLOCK) * cols + c] += d * n;
        }
    }
    Ok(())
}

/// Sizes of the mixer's conv, SSD and gated norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixerDims {
    /// Sequences.
    pub batch: usize,
    /// Steps per sequence.
    pub len: usize,
    /// `d_inner`.
    pub d_inner: usize,
    /// `N`.
    pub d_state: usize,
    /// `G`.
    pub ngroups: usize,
    /// Heads.
    pub nheads: usize,
    /// Conv width `K`.
    pub d_conv: usize,
}

impl MixerDims {
    /// `d_inner + 2·G·N`.
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.ngroups * self.d_state
    }
    /// `batch · len`.
    pub fn rows(&self) -> usize {
        self.batch * self.len
    }
    /// Elements of the conv backward's partial sums: `[batch · conv_tiles(len), conv_dim · (K + 1)]`
    /// (per tile the weight gradient `[conv_dim, K]`, then the bias gradient `[conv_dim]`).
    pub fn conv_partials_len(&self) -> usize {
        self.batch * conv_tiles(self.len) * self.conv_dim() * (self.d_conv + 1)
    }

    fn check(&self, ld: usize, xoff: usize, context: &'static str) -> Result<()> {
        let ok = [self.batch, self.len, self.d_inner, self.d_state, self.ngroups, self.nheads, self.d_conv]
            .iter()
            .all(|&v| v > 0)
            && self.d_conv <= MAX_CONV
            && self.nheads.is_multiple_of(self.ngroups)
            && ld >= xoff + self.conv_dim() + self.nheads;
        if ok {
            Ok(())
        } else {
            Err(Error::Config {
                context,
                message: format!("mixer sizes {self:?} with row stride {ld}, xBC at {xoff} (d_conv <= {MAX_CONV})"),
            })
        }
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu'(x) = σ(x) (1 + x (1 − σ(x)))`.
fn silu_grad(x: f64) -> f64 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// `softplus(x) = max(x, 0) + ln(1 + e^{−|x|})` (as `seq::ops::softplus`).
pub fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Pre-activation of the causal depthwise conv at row `r` (step `t`), column `c`.
#[allow(clippy::too_many_arguments)]
fn conv_pre(d: &MixerDims, zx: &[f64], ld: usize, xoff: usize, w: &[f64], bias: &[f64], r: usize, c: usize) -> f64 {
    let k = d.d_conv;
    let t = r % d.len;
    let mut s = bias[c];
    for j in 0..k {
        if t + j >= k - 1 {
            s += w[c * k + j] * zx[(r + j + 1 - k) * ld + xoff + c];
        }
    }
    s
}

/// Conv forward over `zx [rows, ld]` (the in_proj output; xBC at columns `xoff..`, dt right
/// after it): `xbc[r, c] = silu(bias[c] + Σ_j w[c, j] · zx[r − (K−1) + j, xoff + c])` (zeros
/// before each sequence's start) and `dt[r, h] = softplus(zx[r, xoff + conv_dim + h] + dt_bias[h])`.
#[allow(clippy::too_many_arguments)]
pub fn conv_fwd(
    d: &MixerDims,
    zx: &[f64],
    ld: usize,
    xoff: usize,
    w: &[f64],
    bias: &[f64],
    dt_bias: &[f64],
    xbc: &mut [f64],
    dt: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::conv_fwd";
    d.check(ld, xoff, CTX)?;
    let (cd, nh, rows) = (d.conv_dim(), d.nheads, d.rows());
    need(zx.len(), (rows - 1) * ld + xoff + cd + nh, "zx", CTX)?;
    need(w.len(), cd * d.d_conv, "w", CTX)?;
    need(bias.len(), cd, "bias", CTX)?;
    need(dt_bias.len(), nh, "dt_bias", CTX)?;
    need(xbc.len(), rows * cd, "xbc", CTX)?;
    need(dt.len(), rows * nh, "dt", CTX)?;
    for r in 0..rows {
        for c in 0..cd {
            xbc[r * cd + c] = silu(conv_pre(d, zx, ld, xoff, w, bias, r, c));
        }
        for h in 0..nh {
            dt[r * nh + h] = softplus(zx[r * ld + xoff + cd + h] + dt_bias[h]);
        }
    }
    Ok(())
}

/// Conv backward. The gradient of the conv output is `dx [rows, d_inner]` for the x columns
/// and, for the B and C columns, the sum over the group's heads of `dbc [nheads, rows, 2N]`
/// (the SSD backward's per-head `dB`, `dC`). Writes the gradient of the conv input into
/// `dzx[r·ldo + xoff + c]` and the weight and bias gradients' partial sums per (batch row,
/// tile of [`CONV_TILE`] steps) into `partials` (see [`MixerDims::conv_partials_len`]).
#[allow(clippy::too_many_arguments)]
pub fn conv_bwd(
    d: &MixerDims,
    zx: &[f64],
    ld: usize,
    xoff: usize,
    w: &[f64],
    bias: &[f64],
    dx: &[f64],
    dbc: &[f64],
    dzx: &mut [f64],
    ldo: usize,
    partials: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::conv_bwd";
    d.check(ld, xoff, CTX)?;
    d.check(ldo, xoff, CTX)?;
    let (cd, k, rows, di, n) = (d.conv_dim(), d.d_conv, d.rows(), d.d_inner, d.d_state);
    need(zx.len(), (rows - 1) * ld + xoff + cd, "zx", CTX)?;
    need(w.len(), cd * k, "w", CTX)?;
    need(bias.len(), cd, "bias", CTX)?;
    need(dx.len(), rows * di, "dx", CTX)?;
    need(dbc.len(), d.nheads * rows * 2 * n, "dbc", CTX)?;
    need(dzx.len(), (rows - 1) * ldo + xoff + cd, "dzx", CTX)?;
    need(partials.len(), d.conv_partials_len(), "partials", CTX)?;
    let hpg = d.nheads / d.ngroups;
    let gn = d.ngroups * n;
    // The conv output's gradient times silu' of the pre-activation.
    let dpre = |r: usize, c: usize| -> f64 {
        let dact = if c < di {
            dx[r * di + c]
        } else {
            let (off, within) = if c < di + gn { (0, c - di) } else { (n, c - di - gn) };
            let (grp, kk) = (within / n, within % n);
            (grp * hpg..(grp + 1) * hpg).map(|h| dbc[(h * rows + r) * 2 * n + off + kk]).sum()
        };
        dact * silu_grad(conv_pre(d, zx, ld, xoff, w, bias, r, c))
    };
    let nt = conv_tiles(d.len);
    let width = cd * (k + 1);
    partials[..d.conv_partials_len()].fill(0.0);
    for b in 0..d.batch {
        for t in 0..d.len {
            let r = b * d.len + t;
            let prow = (b * nt + t / CONV_TILE) * width;
            for c in 0..cd {
                // d zx[t] = Σ_j w[c, j] · dpre[t + K − 1 − j] within the sequence.
                let mut s = 0.0;
                for j in 0..k {
                    let tt = t + k - 1 - j;
                    if tt < d.len {
                        s += w[c * k + j] * dpre(r + k - 1 - j, c);
                    }
                }
                dzx[r * ldo + xoff + c] = s;
                let g = dpre(r, c);
                for j in 0..k {
                    if t + j >= k - 1 {
                        partials[prow + c * k + j] += g * zx[(r + j + 1 - k) * ld + xoff + c];
                    }
                }
                partials[prow + cd * k + c] += g;
            }
        }
    }
    Ok(())
}

/// Gated RMSNorm forward, per row and group of `di / G` columns: `v = y ⊙ silu(z)`,
/// `rstd[r, g] = 1 / sqrt(mean_group(v²) + eps)`, `out = v · rstd · w`. `z` is read at
/// `z[r·ldz + c]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_fwd(
    y: &[f64],
    z: &[f64],
    ldz: usize,
    w: &[f64],
    rows: usize,
    di: usize,
    groups: usize,
    eps: f64,
    out: &mut [f64],
    rstd: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::gated_fwd";
    check_gated(y, z, ldz, w, rows, di, groups, CTX)?;
    need(out.len(), rows * di, "out", CTX)?;
    need(rstd.len(), rows * groups, "rstd", CTX)?;
    let gs = di / groups;
    for r in 0..rows {
        for g in 0..groups {
            let v = |c: usize| y[r * di + c] * silu(z[r * ldz + c]);
            let ms = (g * gs..(g + 1) * gs).map(|c| v(c) * v(c)).sum::<f64>() / gs as f64;
            let rs = 1.0 / (ms + eps).sqrt();
            rstd[r * groups + g] = rs;
            for c in g * gs..(g + 1) * gs {
                out[r * di + c] = v(c) * rs * w[c];
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_gated(
    y: &[f64],
    z: &[f64],
    ldz: usize,
    w: &[f64],
    rows: usize,
    di: usize,
    groups: usize,
    context: &'static str,
) -> Result<()> {
    if rows == 0 || groups == 0 || !di.is_multiple_of(groups) || ldz < di {
        return Err(Error::Config {
            context,
            message: format!("rows {rows}, d_inner {di}, {groups} groups, ldz {ldz}"),
        });
    }
    need(y.len(), rows * di, "y", context)?;
    need(z.len(), (rows - 1) * ldz + di, "z", context)?;
    need(w.len(), di, "w", context)
}

/// Gated RMSNorm backward: with `s = silu(z)`, `v = y ⊙ s`, `n = v · rstd`, `g = dout ⊙ w`,
/// `dv = rstd · (g − n · mean_group(g ⊙ n))`; `dy = dv ⊙ s`, `dz = dv ⊙ y ⊙ silu'(z)` (at
/// `dz[r·lddz + c]`) and the weight gradient's partial sums `Σ_{rows of block} dout ⊙ n` per
/// block of [`ROWS_PER_BLOCK`] rows.
#[allow(clippy::too_many_arguments)]
pub fn gated_bwd(
    dout: &[f64],
    y: &[f64],
    z: &[f64],
    ldz: usize,
    w: &[f64],
    rstd: &[f64],
    rows: usize,
    di: usize,
    groups: usize,
    dy: &mut [f64],
    dz: &mut [f64],
    lddz: usize,
    partials: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::gated_bwd";
    check_gated(y, z, ldz, w, rows, di, groups, CTX)?;
    need(dout.len(), rows * di, "dout", CTX)?;
    need(rstd.len(), rows * groups, "rstd", CTX)?;
    need(dy.len(), rows * di, "dy", CTX)?;
    if lddz < di {
        return Err(Error::shape("lddz", CTX, format!(">= {di}"), lddz));
    }
    need(dz.len(), (rows - 1) * lddz + di, "dz", CTX)?;
    need(partials.len(), row_blocks(rows) * di, "partials", CTX)?;
    partials[..row_blocks(rows) * di].fill(0.0);
    let gs = di / groups;
    for r in 0..rows {
        for g in 0..groups {
            let rs = rstd[r * groups + g];
            let cols = g * gs..(g + 1) * gs;
            let n = |c: usize| y[r * di + c] * silu(z[r * ldz + c]) * rs;
            let mean = cols.clone().map(|c| dout[r * di + c] * w[c] * n(c)).sum::<f64>() / gs as f64;
            for c in cols {
                let zz = z[r * ldz + c];
                let dv = rs * (dout[r * di + c] * w[c] - n(c) * mean);
                dy[r * di + c] = dv * silu(zz);
                dz[r * lddz + c] = dv * y[r * di + c] * silu_grad(zz);
                partials[(r / ROWS_PER_BLOCK) * di + c] += dout[r * di + c] * n(c);
            }
        }
    }
    Ok(())
}

/// `norm_f`, the head and the per-row MSE terms: `u_f = rmsnorm(h) · w_norm` (with its
/// `rstd`), `pred = u_f · head_w + head_b`, `sq = (pred − target)²`,
/// `dpred = 2 (pred − target) / rows` (the gradient of the mean).
#[allow(clippy::too_many_arguments)]
pub fn head_fwd(
    h: &[f64],
    w_norm: &[f64],
    head_w: &[f64],
    head_b: f64,
    target: &[f64],
    rows: usize,
    cols: usize,
    eps: f64,
    u_f: &mut [f64],
    rstd: &mut [f64],
    sq: &mut [f64],
    dpred: &mut [f64],
) -> Result<()> {
    const CTX: &str = "mamba2_ref::head_fwd";
    need(target.len(), rows, "target", CTX)?;
    need(head_w.len(), cols, "head_w", CTX)?;
    need(sq.len(), rows, "sq", CTX)?;
    need(dpred.len(), rows, "dpred", CTX)?;
    let mut hh = h.get(..rows * cols).ok_or_else(|| Error::shape("h", CTX, rows * cols, h.len()))?.to_vec();
    rmsnorm_fwd(&mut hh, None, w_norm, None, u_f, rstd, rows, cols, eps)?;
    for r in 0..rows {
        let pred = (0..cols).map(|c| u_f[r * cols + c] * head_w[c]).sum::<f64>() + head_b;
        let e = pred - target[r];
        sq[r] = e * e;
        dpred[r] = 2.0 * e / rows as f64;
    }
    Ok(())
}

/// The loss `mean(sq)` and the head bias gradient `Σ dpred`.
pub fn loss_reduce(sq: &[f64], dpred: &[f64], rows: usize) -> Result<(f64, f64)> {
    const CTX: &str = "mamba2_ref::loss_reduce";
    need(sq.len(), rows, "sq", CTX)?;
    need(dpred.len(), rows, "dpred", CTX)?;
    Ok((sq[..rows].iter().sum::<f64>() / rows as f64, dpred[..rows].iter().sum()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fx_kernels::rng;

    fn vals(n: usize, seed: u64) -> Vec<f64> {
        (0..n as u64).map(|i| rng::draw(seed, 9, 0, i) * 2.0 - 1.0).collect()
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Central difference of `f` along `x[i]`.
    fn fd(x: &[f64], i: usize, f: &dyn Fn(&[f64]) -> f64) -> f64 {
        let eps = 1e-6;
        let (mut a, mut b) = (x.to_vec(), x.to_vec());
        a[i] += eps;
        b[i] -= eps;
        (f(&a) - f(&b)) / (2.0 * eps)
    }

    fn close(got: f64, want: f64, what: &str) {
        assert!(got.is_finite() && (got - want).abs() <= 1e-6 * (1.0 + want.abs()), "{what}: {got} vs numeric {want}");
    }

    fn sums(partials: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        let mut y = vec![0.0; cols];
        col_sums(rows, cols, partials, cols, &mut y).unwrap();
        y
    }

    #[test]
    fn gemm_follows_blas_conventions() {
        let (m, n, k) = (3, 4, 5);
        let a = vals(m * k, 1); // [m, k]
        let b = vals(k * n, 2); // [k, n]
        let want: Vec<f64> =
            (0..m * n).map(|e| (0..k).map(|kk| a[(e / n) * k + kk] * b[kk * n + e % n]).sum()).collect();
        let at: Vec<f64> = (0..k * m).map(|e| a[(e % m) * k + e / m]).collect(); // [k, m]
        let bt: Vec<f64> = (0..n * k).map(|e| b[(e % k) * n + e / k]).collect(); // [n, k]
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let g = GemmShape {
                ta,
                tb,
                m,
                n,
                k,
                lda: if ta { m } else { k },
                ldb: if tb { k } else { n },
                ldc: n + 2,
                beta: 0.0,
            };
            let mut c = vec![f64::NAN; m * (n + 2)];
            gemm(&g, if ta { &at } else { &a }, if tb { &bt } else { &b }, &mut c).unwrap();
            for i in 0..m {
                for j in 0..n {
                    assert!((c[i * (n + 2) + j] - want[i * n + j]).abs() < 1e-12, "{ta} {tb}");
                }
            }
            let mut c2 = c.clone();
            gemm(&GemmShape { beta: 1.0, ..g }, if ta { &at } else { &a }, if tb { &bt } else { &b }, &mut c2).unwrap();
            assert!((c2[0] - 2.0 * want[0]).abs() < 1e-12);
        }
    }

    #[test]
    fn rmsnorm_backward_matches_finite_differences() {
        let (rows, cols) = (40, 6); // two row blocks, the second partial
        let (h, w, r) = (vals(rows * cols, 3), vals(cols, 4), vals(rows * cols, 5));
        let j = |h: &[f64], w: &[f64]| {
            let (mut hh, mut u, mut rs) = (h.to_vec(), vec![0.0; rows * cols], vec![0.0; rows]);
            rmsnorm_fwd(&mut hh, None, w, None, &mut u, &mut rs, rows, cols, 1e-5).unwrap();
            dot(&u, &r)
        };
        let (mut hh, mut u, mut rs) = (h.clone(), vec![0.0; rows * cols], vec![0.0; rows]);
        rmsnorm_fwd(&mut hh, None, &w, None, &mut u, &mut rs, rows, cols, 1e-5).unwrap();
        let base = vals(rows * cols, 6);
        let mut dh = base.clone();
        let mut part = vec![f64::NAN; row_blocks(rows) * cols];
        rmsnorm_bwd(RowGrad::Full(&r), &h, &rs, &w, rows, cols, true, &mut dh, &mut part).unwrap();
        for i in [0, 7, 100, rows * cols - 1] {
            close(dh[i] - base[i], fd(&h, i, &|x| j(x, &w)), &format!("dh[{i}]"));
        }
        let dw = sums(&part, row_blocks(rows), cols);
        for c in 0..cols {
            close(dw[c], fd(&w, c, &|x| j(&h, x)), &format!("dw[{c}]"));
        }
        // The outer-product form equals the full one.
        let (scale, vec) = (vals(rows, 7), vals(cols, 8));
        let full: Vec<f64> = (0..rows * cols).map(|e| scale[e / cols] * vec[e % cols]).collect();
        let (mut d1, mut d2) = (vec![0.0; rows * cols], vec![0.0; rows * cols]);
        let (mut p1, mut p2) = (part.clone(), part.clone());
        rmsnorm_bwd(RowGrad::Full(&full), &h, &rs, &w, rows, cols, false, &mut d1, &mut p1).unwrap();
        rmsnorm_bwd(RowGrad::Outer { scale: &scale, vec: &vec }, &h, &rs, &w, rows, cols, false, &mut d2, &mut p2)
            .unwrap();
        assert!(d1.iter().zip(&d2).all(|(a, b)| (a - b).abs() < 1e-12));
        assert!(p1.iter().zip(&p2).all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn rmsnorm_bias_and_copy() {
        let (rows, cols) = (3, 5);
        let (h0, b, w) = (vals(rows * cols, 1), vals(cols, 2), vals(cols, 3));
        let mut h = h0.clone();
        let (mut copy, mut u, mut rs) = (vec![0.0; rows * cols], vec![0.0; rows * cols], vec![0.0; rows]);
        rmsnorm_fwd(&mut h, Some(&b), &w, Some(&mut copy), &mut u, &mut rs, rows, cols, 1e-5).unwrap();
        for e in 0..rows * cols {
            assert_eq!(h[e], h0[e] + b[e % cols]);
            assert_eq!(copy[e], h[e]);
        }
    }

    fn mixer(batch: usize, len: usize, k: usize) -> MixerDims {
        MixerDims { batch, len, d_inner: 4, d_state: 2, ngroups: 2, nheads: 4, d_conv: k }
    }

    #[test]
    fn conv_backward_matches_finite_differences() {
        for (len, k) in [(37usize, 3usize), (5, 4), (2, 4), (9, 1)] {
            let d = mixer(2, len, k);
            let (cd, rows, nh) = (d.conv_dim(), d.rows(), d.nheads);
            let xoff = 3;
            let ld = xoff + cd + nh + 2;
            let zx = vals(rows * ld, 11);
            let (w, bias, dtb) = (vals(cd * k, 12), vals(cd, 13), vals(nh, 14));
            let dx = vals(rows * d.d_inner, 15);
            let dbc = vals(nh * rows * 2 * d.d_state, 16);
            // J = Σ xbc ⊙ R with R the gradient the backward receives (dx, group sums of dbc).
            let hpg = nh / d.ngroups;
            let (n, gn, di) = (d.d_state, d.ngroups * d.d_state, d.d_inner);
            let rmat: Vec<f64> = (0..rows * cd)
                .map(|e| {
                    let (r, c) = (e / cd, e % cd);
                    if c < di {
                        dx[r * di + c]
                    } else {
                        let (off, within) = if c < di + gn { (0, c - di) } else { (n, c - di - gn) };
                        let (grp, kk) = (within / n, within % n);
                        (grp * hpg..(grp + 1) * hpg).map(|h| dbc[(h * rows + r) * 2 * n + off + kk]).sum()
                    }
                })
                .collect();
            let j = |zx: &[f64], w: &[f64], b: &[f64]| {
                let (mut xbc, mut dt) = (vec![0.0; rows * cd], vec![0.0; rows * nh]);
                conv_fwd(&d, zx, ld, xoff, w, b, &dtb, &mut xbc, &mut dt).unwrap();
                dot(&xbc, &rmat)
            };
            let mut dzx = vec![f64::NAN; rows * ld];
            let mut part = vec![f64::NAN; d.conv_partials_len()];
            conv_bwd(&d, &zx, ld, xoff, &w, &bias, &dx, &dbc, &mut dzx, ld, &mut part).unwrap();
            for &(r, c) in &[(0usize, 0usize), (1, 5), (len - 1, cd - 1), (rows - 1, 2), (len, 7)] {
                let i = r * ld + xoff + c;
                close(dzx[i], fd(&zx, i, &|x| j(x, &w, &bias)), &format!("len {len} k {k}: dzx[{r}, {c}]"));
            }
            let ntile = d.batch * conv_tiles(len);
            let g = sums(&part, ntile, cd * (k + 1));
            for e in [0, k - 1, cd * k - 1, 5] {
                close(g[e], fd(&w, e, &|x| j(&zx, x, &bias)), &format!("len {len} k {k}: dw[{e}]"));
            }
            for c in [0, cd - 1] {
                close(g[cd * k + c], fd(&bias, c, &|x| j(&zx, &w, x)), &format!("dbias[{c}]"));
            }
            // dt = softplus(zx_dt + dt_bias)
            let (mut xbc, mut dt) = (vec![0.0; rows * cd], vec![0.0; rows * nh]);
            conv_fwd(&d, &zx, ld, xoff, &w, &bias, &dtb, &mut xbc, &mut dt).unwrap();
            assert!((dt[nh + 1] - softplus(zx[ld + xoff + cd + 1] + dtb[1])).abs() < 1e-15);
        }
    }

    #[test]
    fn gated_backward_matches_finite_differences() {
        let (rows, di, groups, ldz) = (35, 6, 2, 9);
        let (y, z, w, r) = (vals(rows * di, 21), vals(rows * ldz, 22), vals(di, 23), vals(rows * di, 24));
        let j = |y: &[f64], z: &[f64], w: &[f64]| {
            let (mut out, mut rs) = (vec![0.0; rows * di], vec![0.0; rows * groups]);
            gated_fwd(y, z, ldz, w, rows, di, groups, 1e-5, &mut out, &mut rs).unwrap();
            dot(&out, &r)
        };
        let (mut out, mut rs) = (vec![0.0; rows * di], vec![0.0; rows * groups]);
        gated_fwd(&y, &z, ldz, &w, rows, di, groups, 1e-5, &mut out, &mut rs).unwrap();
        let (mut dy, mut dz, mut part) = (vec![0.0; rows * di], vec![f64::NAN; rows * ldz], vec![0.0; 2 * di]);
        gated_bwd(&r, &y, &z, ldz, &w, &rs, rows, di, groups, &mut dy, &mut dz, ldz, &mut part).unwrap();
        for i in [0, 5, 77, rows * di - 1] {
            close(dy[i], fd(&y, i, &|x| j(x, &z, &w)), &format!("dy[{i}]"));
        }
        for (r0, c) in [(0usize, 0usize), (3, 5), (rows - 1, 2)] {
            let i = r0 * ldz + c;
            close(dz[i], fd(&z, i, &|x| j(&y, x, &w)), &format!("dz[{r0}, {c}]"));
        }
        let dw = sums(&part, row_blocks(rows), di);
        for c in 0..di {
            close(dw[c], fd(&w, c, &|x| j(&y, &z, x)), &format!("dw[{c}]"));
        }
    }

    #[test]
    fn head_gradients_match_finite_differences() {
        let (rows, cols) = (34, 5);
        let (h, wn, hw, t) = (vals(rows * cols, 31), vals(cols, 32), vals(cols, 33), vals(rows, 34));
        let hb = 0.3;
        let loss = |h: &[f64], wn: &[f64], hw: &[f64], hb: f64| {
            let (mut uf, mut rs, mut sq, mut dp) =
                (vec![0.0; rows * cols], vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
            head_fwd(h, wn, hw, hb, &t, rows, cols, 1e-5, &mut uf, &mut rs, &mut sq, &mut dp).unwrap();
            loss_reduce(&sq, &dp, rows).unwrap().0
        };
        let (mut uf, mut rs, mut sq, mut dp) =
            (vec![0.0; rows * cols], vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        head_fwd(&h, &wn, &hw, hb, &t, rows, cols, 1e-5, &mut uf, &mut rs, &mut sq, &mut dp).unwrap();
        let (_, dhb) = loss_reduce(&sq, &dp, rows).unwrap();
        close(dhb, fd(&[hb], 0, &|x| loss(&h, &wn, &hw, x[0])), "head_b");
        // head_w: Σ_r dpred[r] u_f[r]
        let mut dhw = vec![0.0; cols];
        gemm(
            &GemmShape { ta: true, tb: false, m: 1, n: cols, k: rows, lda: 1, ldb: cols, ldc: cols, beta: 0.0 },
            &dp,
            &uf,
            &mut dhw,
        )
        .unwrap();
        for c in 0..cols {
            close(dhw[c], fd(&hw, c, &|x| loss(&h, &wn, x, hb)), &format!("head_w[{c}]"));
        }
        let mut dh = vec![0.0; rows * cols];
        let mut part = vec![0.0; row_blocks(rows) * cols];
        rmsnorm_bwd(RowGrad::Outer { scale: &dp, vec: &hw }, &h, &rs, &wn, rows, cols, false, &mut dh, &mut part)
            .unwrap();
        for i in [0, 9, rows * cols - 1] {
            close(dh[i], fd(&h, i, &|x| loss(x, &wn, &hw, hb)), &format!("dh[{i}]"));
        }
        let dwn = sums(&part, row_blocks(rows), cols);
        for c in 0..cols {
            close(dwn[c], fd(&wn, c, &|x| loss(&h, x, &hw, hb)), &format!("norm_f[{c}]"));
        }
    }

    #[test]
    fn short_buffers_are_errors() {
        let mut u = vec![0.0; 3];
        let mut rs = vec![0.0; 1];
        assert!(rmsnorm_fwd(&mut [0.0; 4], None, &[1.0; 4], None, &mut u, &mut rs, 1, 4, 1e-5).is_err());
        let d = mixer(1, 4, MAX_CONV + 1);
        let (mut a, mut b) = (vec![0.0; 100], vec![0.0; 100]);
        assert!(conv_fwd(&d, &[0.0; 400], 100, 0, &[0.0; 100], &[0.0; 100], &[0.0; 4], &mut a, &mut b).is_err());
    }
}
