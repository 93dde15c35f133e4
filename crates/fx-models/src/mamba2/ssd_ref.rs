//! The SSD scan of MAMBA-2 (MODELS.md "MAMBA-2") as `kernels/mamba2/ssd.cu` computes it, in f64 on
//! the CPU: the chunked forward and backward in the kernels' order of operations
//! ([`ssd_fwd_chunked`], [`ssd_bwd_chunked`]) and the plain recurrence with its step-by-step
//! reverse mode ([`ssd_fwd_recurrent`], [`ssd_bwd_recurrent`]) that they must equal. The
//! device tests compare the kernels with the chunked functions; the tests here compare the
//! chunked functions with the recurrence and the recurrence with finite differences, so a
//! mistake in the chunk algebra shows without a GPU.
//!
//! Per batch row `b` and head `h`, with `X_t` the head's `[P]` slice of the conv output,
//! `B_t`, `C_t` `[N]` of the head's group, `dt_t` (after softplus), `A = −exp(A_log_h)`:
//! `H_t = e^{A·dt_t} H_{t−1} + (X_t·dt_t) B_tᵀ` from `H_{−1} = 0`, `y_t = H_t C_t`, output
//! `y_t + D_h X_t`. The backward takes the output's gradient `dy` and returns the gradients
//! of the conv output (x, B, C), of `dt_raw` (pre-softplus: `d dt · sigmoid(dt_raw + bias)`,
//! which equals `d dt · (1 − e^{−dt})`) and per-batch-row partial sums of the `dt_bias`,
//! `A_log` and `D` gradients.
//!
//! Buffer layouts (rows `r = b·len + t`, batch-major, as the fused MAMBA-2 step keeps them):
//! - `xbc [rows, ld_xbc]`: x of head `h` at columns `h·P ..`, B of group `g` at
//!   `d_inner + g·N ..`, C at `d_inner + G·N + g·N ..` (the conv + SiLU output);
//! - `dt [rows, nheads]`; `a_log`, `d` `[nheads]`;
//! - `y_ssd` (before the `D` skip), `y_out` (after it), `dy`, `dx` `[rows, d_inner]`;
//! - `states [batch, nheads, n_chunks, P, N]`: the state entering each chunk;
//! - `dbc [nheads, rows, 2N]`: each head's `dB` then `dC` (summed over a group's heads later);
//! - `ddt_raw`: element `r·ld_ddt + h` of its slice;
//! - `partials [batch, 3·nheads]`: `dt_bias`, `A_log`, `D` gradient sums over `t`.

use fx_kernels::{Error, Result};

/// Largest head dimension, state size and chunk length the kernels take (their shared-memory
/// tiles are 64 × 64).
pub const SSD_MAX_DIM: usize = 64;

/// Sizes of one SSD scan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdDims {
    /// Sequences.
    pub batch: usize,
    /// Steps per sequence.
    pub len: usize,
    /// Heads.
    pub nheads: usize,
    /// Channels per head `P`.
    pub headdim: usize,
    /// State size `N`.
    pub d_state: usize,
    /// B/C groups.
    pub ngroups: usize,
    /// Chunk length of the chunked algorithm (any value gives the same result).
    pub chunk: usize,
}

impl SsdDims {
    /// `nheads · headdim`.
    pub fn d_inner(&self) -> usize {
        self.nheads * self.headdim
    }
    /// `batch · len`.
    pub fn rows(&self) -> usize {
        self.batch * self.len
    }
    /// Chunks per sequence (the last may be partial).
    pub fn n_chunks(&self) -> usize {
        self.len.div_ceil(self.chunk.max(1))
    }
    /// Columns of the conv output (x, B, C).
    pub fn xbc_width(&self) -> usize {
        self.d_inner() + 2 * self.ngroups * self.d_state
    }
    /// Elements of the chunk-state buffer.
    pub fn states_len(&self) -> usize {
        self.batch * self.nheads * self.n_chunks() * self.headdim * self.d_state
    }
    /// Elements of the per-head `dB`/`dC` buffer.
    pub fn dbc_len(&self) -> usize {
        self.nheads * self.rows() * 2 * self.d_state
    }
    /// Elements of the backward's partial sums.
    pub fn partials_len(&self) -> usize {
        self.batch * 3 * self.nheads
    }

    /// Checks the sizes against the kernels' limits.
    pub fn check(&self, context: &'static str) -> Result<()> {
        let positive = [self.batch, self.len, self.nheads, self.headdim, self.d_state, self.ngroups, self.chunk]
            .iter()
            .all(|&v| v > 0);
        let fits = self.headdim <= SSD_MAX_DIM && self.d_state <= SSD_MAX_DIM && self.chunk <= SSD_MAX_DIM;
        let grouped = positive && self.nheads.is_multiple_of(self.ngroups);
        let small = self.rows() < (1 << 31) && self.xbc_width() < (1 << 20) && self.dbc_len() < (1 << 40);
        if positive && fits && grouped && small {
            Ok(())
        } else {
            Err(Error::Config {
                context,
                message: format!(
                    "SSD sizes {self:?}: need positive sizes, headdim, d_state and chunk <= {SSD_MAX_DIM}, \
                     ngroups | nheads"
                ),
            })
        }
    }
}

/// The forward's inputs (see the module docs for the layouts).
#[derive(Debug, Clone, Copy)]
pub struct SsdInputs<'a> {
    /// Conv output `[rows, ld_xbc]`.
    pub xbc: &'a [f64],
    /// Row stride of `xbc`.
    pub ld_xbc: usize,
    /// `dt` after softplus `[rows, nheads]`.
    pub dt: &'a [f64],
    /// `[nheads]`.
    pub a_log: &'a [f64],
    /// `[nheads]`.
    pub d: &'a [f64],
}

/// The backward's outputs (see the module docs for the layouts).
#[derive(Debug)]
pub struct SsdGrads<'a> {
    /// Gradient of the conv output's x columns `[rows, d_inner]`.
    pub dx: &'a mut [f64],
    /// Per-head `dB`, `dC` `[nheads, rows, 2N]`.
    pub dbc: &'a mut [f64],
    /// Gradient of `dt_raw` at `r·ld_ddt + h`.
    pub ddt_raw: &'a mut [f64],
    /// Row stride of `ddt_raw`.
    pub ld_ddt: usize,
    /// `[batch, 3·nheads]`: `dt_bias`, `A_log`, `D` gradient sums.
    pub partials: &'a mut [f64],
}

pub(crate) fn need(len: usize, min: usize, what: &'static str, context: &'static str) -> Result<()> {
    if len < min {
        return Err(Error::shape(what, context, format!("at least {min} elements"), len));
    }
    Ok(())
}

fn check_inputs(d: &SsdDims, i: &SsdInputs, context: &'static str) -> Result<()> {
    d.check(context)?;
    if i.ld_xbc < d.xbc_width() {
        return Err(Error::shape("ld_xbc", context, format!(">= {}", d.xbc_width()), i.ld_xbc));
    }
    need(i.xbc.len(), (d.rows() - 1) * i.ld_xbc + d.xbc_width(), "xbc", context)?;
    need(i.dt.len(), d.rows() * d.nheads, "dt", context)?;
    need(i.a_log.len(), d.nheads, "a_log", context)?;
    need(i.d.len(), d.nheads, "d", context)
}

/// One chunk of one (batch row, head), zero-padded past the sequence end (`dt = 0` there, so
/// the padding decays nothing and adds nothing).
struct Chunk {
    /// `[Q][P]`, `[Q][N]`, `[Q][N]`, `[Q]`.
    x: Vec<f64>,
    bm: Vec<f64>,
    cm: Vec<f64>,
    dt: Vec<f64>,
    /// Inclusive cumulative sum of `A·dt` within the chunk.
    ac: Vec<f64>,
    /// Whether row `i` is a real step.
    valid: Vec<bool>,
}

fn load_chunk(d: &SsdDims, inp: &SsdInputs, b: usize, h: usize, t0: usize) -> Chunk {
    let (q, p, n) = (d.chunk, d.headdim, d.d_state);
    let grp = h / (d.nheads / d.ngroups);
    let (xcol, bcol, ccol) = (h * p, d.d_inner() + grp * n, d.d_inner() + d.ngroups * n + grp * n);
    let a = -inp.a_log[h].exp();
    let mut c = Chunk {
        x: vec![0.0; q * p],
        bm: vec![0.0; q * n],
        cm: vec![0.0; q * n],
        dt: vec![0.0; q],
        ac: vec![0.0; q],
        valid: vec![false; q],
    };
    let mut acc = 0.0;
    for i in 0..q {
        let t = t0 + i;
        if t < d.len {
            let r = b * d.len + t;
            let row = &inp.xbc[r * inp.ld_xbc..];
            c.x[i * p..(i + 1) * p].copy_from_slice(&row[xcol..xcol + p]);
            c.bm[i * n..(i + 1) * n].copy_from_slice(&row[bcol..bcol + n]);
            c.cm[i * n..(i + 1) * n].copy_from_slice(&row[ccol..ccol + n]);
            c.dt[i] = inp.dt[r * d.nheads + h];
            c.valid[i] = true;
        }
        acc += a * c.dt[i];
        c.ac[i] = acc;
    }
    c
}

/// Chunked forward: `y_ssd`, `y_out` `[rows, d_inner]` and the chunk-entry `states`.
pub fn ssd_fwd_chunked(
    d: &SsdDims,
    inp: &SsdInputs,
    y_ssd: &mut [f64],
    y_out: &mut [f64],
    states: &mut [f64],
) -> Result<()> {
    const CTX: &str = "ssd_ref::ssd_fwd_chunked";
    check_inputs(d, inp, CTX)?;
    let di = d.d_inner();
    need(y_ssd.len(), d.rows() * di, "y_ssd", CTX)?;
    need(y_out.len(), d.rows() * di, "y_out", CTX)?;
    need(states.len(), d.states_len(), "states", CTX)?;
    let (q, p, n, nc) = (d.chunk, d.headdim, d.d_state, d.n_chunks());
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let dsk = inp.d[h];
            let mut hs = vec![0.0; p * n]; // H[p][n]
            for c in 0..nc {
                let st0 = ((b * d.nheads + h) * nc + c) * p * n;
                states[st0..st0 + p * n].copy_from_slice(&hs);
                let t0 = c * q;
                let ch = load_chunk(d, inp, b, h, t0);
                // M[i][j] = (C_i·B_j) e^{ac_i − ac_j} dt_j for j ≤ i: the intra-chunk weights,
                // dt folded in so that M·X is the contribution of x = X·dt.
                let mut m = vec![0.0; q * q];
                for i in 0..q {
                    for j in 0..=i {
                        let s: f64 = (0..n).map(|k| ch.cm[i * n + k] * ch.bm[j * n + k]).sum();
                        m[i * q + j] = s * (ch.ac[i] - ch.ac[j]).exp() * ch.dt[j];
                    }
                }
                for i in 0..q {
                    if !ch.valid[i] {
                        continue;
                    }
                    let r = b * d.len + t0 + i;
                    let ea = ch.ac[i].exp();
                    for pp in 0..p {
                        let off: f64 = (0..n).map(|k| ch.cm[i * n + k] * hs[pp * n + k]).sum();
                        let diag: f64 = (0..q).map(|j| m[i * q + j] * ch.x[j * p + pp]).sum();
                        let v = ea * off + diag;
                        y_ssd[r * di + h * p + pp] = v;
                        y_out[r * di + h * p + pp] = v + dsk * ch.x[i * p + pp];
                    }
                }
                let last = ch.ac[q - 1];
                for pp in 0..p {
                    for k in 0..n {
                        let add: f64 = (0..q)
                            .map(|j| ch.x[j * p + pp] * ch.dt[j] * (last - ch.ac[j]).exp() * ch.bm[j * n + k])
                            .sum();
                        hs[pp * n + k] = last.exp() * hs[pp * n + k] + add;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The plain recurrence, one step at a time: `y_ssd`, `y_out` `[rows, d_inner]`.
pub fn ssd_fwd_recurrent(d: &SsdDims, inp: &SsdInputs, y_ssd: &mut [f64], y_out: &mut [f64]) -> Result<()> {
    const CTX: &str = "ssd_ref::ssd_fwd_recurrent";
    check_inputs(d, inp, CTX)?;
    let di = d.d_inner();
    need(y_ssd.len(), d.rows() * di, "y_ssd", CTX)?;
    need(y_out.len(), d.rows() * di, "y_out", CTX)?;
    let (p, n) = (d.headdim, d.d_state);
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let hist = state_history(d, inp, b, h);
            for t in 0..d.len {
                let r = b * d.len + t;
                let (x, _, cm, _) = step_inputs(d, inp, r, h);
                for pp in 0..p {
                    let y: f64 = (0..n).map(|k| hist[t + 1][pp * n + k] * cm[k]).sum();
                    y_ssd[r * di + h * p + pp] = y;
                    y_out[r * di + h * p + pp] = y + inp.d[h] * x[pp];
                }
            }
        }
    }
    Ok(())
}

/// `(X_t, B_t, C_t, dt_t)` of head `h` at row `r`.
fn step_inputs<'a>(d: &SsdDims, inp: &SsdInputs<'a>, r: usize, h: usize) -> (&'a [f64], &'a [f64], &'a [f64], f64) {
    let (p, n) = (d.headdim, d.d_state);
    let grp = h / (d.nheads / d.ngroups);
    let row = &inp.xbc[r * inp.ld_xbc..];
    let bcol = d.d_inner() + grp * n;
    let ccol = d.d_inner() + d.ngroups * n + grp * n;
    (&row[h * p..h * p + p], &row[bcol..bcol + n], &row[ccol..ccol + n], inp.dt[r * d.nheads + h])
}

/// `H_{−1} = 0, H_0, …, H_{len−1}` of one (batch row, head), each `[P][N]`.
fn state_history(d: &SsdDims, inp: &SsdInputs, b: usize, h: usize) -> Vec<Vec<f64>> {
    let (p, n) = (d.headdim, d.d_state);
    let a = -inp.a_log[h].exp();
    let mut hist = vec![vec![0.0; p * n]];
    for t in 0..d.len {
        let (x, bm, _, dt) = step_inputs(d, inp, b * d.len + t, h);
        let prev = &hist[t];
        let decay = (a * dt).exp();
        let next: Vec<f64> = (0..p * n).map(|e| decay * prev[e] + x[e / n] * dt * bm[e % n]).collect();
        hist.push(next);
    }
    hist
}

fn check_grads(d: &SsdDims, y_ssd: &[f64], dy: &[f64], g: &SsdGrads, context: &'static str) -> Result<()> {
    let di = d.d_inner();
    need(y_ssd.len(), d.rows() * di, "y_ssd", context)?;
    need(dy.len(), d.rows() * di, "dy", context)?;
    need(g.dx.len(), d.rows() * di, "dx", context)?;
    need(g.dbc.len(), d.dbc_len(), "dbc", context)?;
    if g.ld_ddt < d.nheads {
        return Err(Error::shape("ld_ddt", context, format!(">= {}", d.nheads), g.ld_ddt));
    }
    need(g.ddt_raw.len(), (d.rows() - 1) * g.ld_ddt + d.nheads, "ddt_raw", context)?;
    need(g.partials.len(), d.partials_len(), "partials", context)
}

/// What both backward passes do with a row's `dx` (gradient of `x = X·dt`), `da` and the
/// row sums: the conv-output and `dt_raw` gradients and the partial sums.
struct RowTail<'a> {
    d: &'a SsdDims,
    h: usize,
    a: f64,
    dsk: f64,
}

impl RowTail<'_> {
    /// Writes `dX = dx·dt + D·dy` and returns `Σ X·dx` (the `x·dx` term's factor).
    fn dx(&self, g: &mut SsdGrads, r: usize, x: &[f64], dx: &[f64], dy: &[f64], dt: f64) -> f64 {
        let (p, di) = (self.d.headdim, self.d.d_inner());
        let mut s = 0.0;
        for pp in 0..p {
            g.dx[r * di + self.h * p + pp] = dx[pp] * dt + self.dsk * dy[pp];
            s += x[pp] * dx[pp];
        }
        s
    }

    /// `d dt_raw` from `Σ X·dx` and `da`; adds to the row's partial sums.
    #[allow(clippy::too_many_arguments)]
    fn dt(&self, g: &mut SsdGrads, b: usize, r: usize, xdx: f64, da: f64, dt: f64, dyx: f64) {
        let nh = self.d.nheads;
        let ddt = xdx + self.a * da;
        let raw = ddt * -(-dt).exp_m1();
        g.ddt_raw[r * g.ld_ddt + self.h] = raw;
        g.partials[b * 3 * nh + self.h] += raw;
        g.partials[b * 3 * nh + nh + self.h] += da * dt * self.a;
        g.partials[b * 3 * nh + 2 * nh + self.h] += dyx;
    }
}

/// Chunked backward in the kernel's order: chunks in reverse carrying the state gradient `G`
/// and the reverse cumulative sum of `dy·y − x·dx` (the `da` of every earlier step).
pub fn ssd_bwd_chunked(
    d: &SsdDims,
    inp: &SsdInputs,
    y_ssd: &[f64],
    states: &[f64],
    dy: &[f64],
    g: &mut SsdGrads,
) -> Result<()> {
    const CTX: &str = "ssd_ref::ssd_bwd_chunked";
    check_inputs(d, inp, CTX)?;
    check_grads(d, y_ssd, dy, g, CTX)?;
    need(states.len(), d.states_len(), "states", CTX)?;
    let (q, p, n, nc, di, nh) = (d.chunk, d.headdim, d.d_state, d.n_chunks(), d.d_inner(), d.nheads);
    let rows = d.rows();
    g.partials[..d.partials_len()].fill(0.0);
    for b in 0..d.batch {
        for h in 0..nh {
            let tail = RowTail { d, h, a: -inp.a_log[h].exp(), dsk: inp.d[h] };
            let mut gs = vec![0.0; p * n]; // G[p][n]: gradient of the state leaving the chunk
            let mut carry = 0.0;
            for c in (0..nc).rev() {
                let t0 = c * q;
                let ch = load_chunk(d, inp, b, h, t0);
                let mut dyc = vec![0.0; q * p];
                let mut yc = vec![0.0; q * p];
                for i in 0..q {
                    if ch.valid[i] {
                        let r = b * d.len + t0 + i;
                        dyc[i * p..(i + 1) * p].copy_from_slice(&dy[r * di + h * p..r * di + h * p + p]);
                        yc[i * p..(i + 1) * p].copy_from_slice(&y_ssd[r * di + h * p..r * di + h * p + p]);
                    }
                }
                let last = ch.ac[q - 1];
                let e_l: Vec<f64> = ch.ac.iter().map(|a| (last - a).exp()).collect();
                let e_a: Vec<f64> = ch.ac.iter().map(|a| a.exp()).collect();
                let lmask = |i: usize, j: usize| if j <= i { (ch.ac[i] - ch.ac[j]).exp() } else { 0.0 };
                // M[i][j] = (C_i·B_j) e^{ac_i − ac_j}, j ≤ i.
                let mut m = vec![0.0; q * q];
                for i in 0..q {
                    for j in 0..=i {
                        m[i * q + j] = (0..n).map(|k| ch.cm[i * n + k] * ch.bm[j * n + k]).sum::<f64>() * lmask(i, j);
                    }
                }
                // dx[j] = e_l[j] (B_j Gᵀ) + Σ_i M[i][j] dy_i, and the row sums.
                let (mut r1, mut r2, mut rd) = (vec![0.0; q], vec![0.0; q], vec![0.0; q]);
                for j in 0..q {
                    let dxj: Vec<f64> = (0..p)
                        .map(|pp| {
                            let s: f64 = (0..n).map(|k| ch.bm[j * n + k] * gs[pp * n + k]).sum();
                            e_l[j] * s + (0..q).map(|i| m[i * q + j] * dyc[i * p + pp]).sum::<f64>()
                        })
                        .collect();
                    if ch.valid[j] {
                        let r = b * d.len + t0 + j;
                        r1[j] = tail.dx(g, r, &ch.x[j * p..(j + 1) * p], &dxj, &dyc[j * p..(j + 1) * p], ch.dt[j]);
                        r2[j] = (0..p).map(|pp| dyc[j * p + pp] * yc[j * p + pp]).sum();
                        rd[j] = (0..p).map(|pp| dyc[j * p + pp] * ch.x[j * p + pp]).sum();
                    }
                }
                // da_j = Σ_{k ≥ j} (dy_k·y_k − x_k·dx_k) over the rest of the sequence.
                for j in (0..q).rev() {
                    carry += r2[j] - ch.dt[j] * r1[j];
                    if ch.valid[j] {
                        tail.dt(g, b, b * d.len + t0 + j, r1[j], carry, ch.dt[j], rd[j]);
                    }
                }
                // W[i][j] = (dy_i·X_j) e^{ac_i − ac_j} dt_j, j ≤ i.
                let mut w = vec![0.0; q * q];
                for i in 0..q {
                    for j in 0..=i {
                        let s: f64 = (0..p).map(|pp| dyc[i * p + pp] * ch.x[j * p + pp]).sum();
                        w[i * q + j] = s * lmask(i, j) * ch.dt[j];
                    }
                }
                let st0 = ((b * nh + h) * nc + c) * p * n;
                let hin = &states[st0..st0 + p * n];
                for j in 0..q {
                    if !ch.valid[j] {
                        continue;
                    }
                    let r = b * d.len + t0 + j;
                    let base = (h * rows + r) * 2 * n;
                    for k in 0..n {
                        let xg: f64 = (0..p).map(|pp| ch.x[j * p + pp] * gs[pp * n + k]).sum();
                        let wc: f64 = (0..q).map(|i| w[i * q + j] * ch.cm[i * n + k]).sum();
                        g.dbc[base + k] = e_l[j] * ch.dt[j] * xg + wc;
                        let dh: f64 = (0..p).map(|pp| dyc[j * p + pp] * hin[pp * n + k]).sum();
                        let wb: f64 = (0..q).map(|jj| w[j * q + jj] * ch.bm[jj * n + k]).sum();
                        g.dbc[base + n + k] = e_a[j] * dh + wb;
                    }
                }
                // G ← e^{ac_last} G + Σ_i e^{ac_i} dy_i C_iᵀ: the gradient of the state entering.
                for pp in 0..p {
                    for k in 0..n {
                        let s: f64 = (0..q).map(|i| dyc[i * p + pp] * e_a[i] * ch.cm[i * n + k]).sum();
                        gs[pp * n + k] = last.exp() * gs[pp * n + k] + s;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Reverse mode of the plain recurrence, step by step from the end, with the decay's gradient
/// taken directly as `⟨G_t, e^{a_t} H_{t−1}⟩` (independent of the chunked form's cumulative
/// sum).
pub fn ssd_bwd_recurrent(d: &SsdDims, inp: &SsdInputs, y_ssd: &[f64], dy: &[f64], g: &mut SsdGrads) -> Result<()> {
    const CTX: &str = "ssd_ref::ssd_bwd_recurrent";
    check_inputs(d, inp, CTX)?;
    check_grads(d, y_ssd, dy, g, CTX)?;
    let (p, n, di, nh, rows) = (d.headdim, d.d_state, d.d_inner(), d.nheads, d.rows());
    g.partials[..d.partials_len()].fill(0.0);
    for b in 0..d.batch {
        for h in 0..nh {
            let tail = RowTail { d, h, a: -inp.a_log[h].exp(), dsk: inp.d[h] };
            let hist = state_history(d, inp, b, h);
            let mut carry = vec![0.0; p * n]; // e^{a_{t+1}} G_{t+1}
            for t in (0..d.len).rev() {
                let r = b * d.len + t;
                let (x, bm, cm, dt) = step_inputs(d, inp, r, h);
                let dyt = &dy[r * di + h * p..r * di + h * p + p];
                let gt: Vec<f64> = (0..p * n).map(|e| dyt[e / n] * cm[e % n] + carry[e]).collect();
                let dx: Vec<f64> = (0..p).map(|pp| (0..n).map(|k| gt[pp * n + k] * bm[k]).sum()).collect();
                let base = (h * rows + r) * 2 * n;
                for k in 0..n {
                    g.dbc[base + k] = (0..p).map(|pp| gt[pp * n + k] * x[pp] * dt).sum();
                    g.dbc[base + n + k] = (0..p).map(|pp| hist[t + 1][pp * n + k] * dyt[pp]).sum();
                }
                let decay = (tail.a * dt).exp();
                let da: f64 = (0..p * n).map(|e| gt[e] * decay * hist[t][e]).sum();
                let xdx = tail.dx(g, r, x, &dx, dyt, dt);
                let dyx: f64 = (0..p).map(|pp| dyt[pp] * x[pp]).sum();
                tail.dt(g, b, r, xdx, da, dt, dyx);
                carry = gt.iter().map(|v| v * decay).collect();
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fx_kernels::rng;

    /// Random SSD inputs: x, B, C in [−1, 1), dt in (0.01, 0.5), `A = −U(1, 16)`, D in [−1, 1).
    pub(crate) struct Case {
        pub dims: SsdDims,
        pub xbc: Vec<f64>,
        pub dt: Vec<f64>,
        pub a_log: Vec<f64>,
        pub d: Vec<f64>,
        pub dy: Vec<f64>,
    }

    fn u(seed: u64, stream: u64, i: usize) -> f64 {
        rng::draw(seed, stream, 0, i as u64)
    }

    pub(crate) fn case(dims: SsdDims, seed: u64) -> Case {
        let w = dims.xbc_width();
        let rows = dims.rows();
        Case {
            dims,
            xbc: (0..rows * w).map(|i| u(seed, 1, i) * 2.0 - 1.0).collect(),
            dt: (0..rows * dims.nheads).map(|i| 0.01 + 0.49 * u(seed, 2, i)).collect(),
            a_log: (0..dims.nheads).map(|i| (1.0 + 15.0 * u(seed, 3, i)).ln()).collect(),
            d: (0..dims.nheads).map(|i| u(seed, 4, i) * 2.0 - 1.0).collect(),
            dy: (0..rows * dims.d_inner()).map(|i| u(seed, 5, i) * 2.0 - 1.0).collect(),
        }
    }

    impl Case {
        fn inputs(&self) -> SsdInputs<'_> {
            SsdInputs { xbc: &self.xbc, ld_xbc: self.dims.xbc_width(), dt: &self.dt, a_log: &self.a_log, d: &self.d }
        }
    }

    struct Out {
        dx: Vec<f64>,
        dbc: Vec<f64>,
        ddt: Vec<f64>,
        partials: Vec<f64>,
    }

    fn grads(d: &SsdDims) -> Out {
        Out {
            dx: vec![f64::NAN; d.rows() * d.d_inner()],
            dbc: vec![f64::NAN; d.dbc_len()],
            ddt: vec![f64::NAN; d.rows() * d.nheads],
            partials: vec![f64::NAN; d.partials_len()],
        }
    }

    fn run_bwd(c: &Case, chunked: bool) -> Out {
        let d = &c.dims;
        let n = d.rows() * d.d_inner();
        let (mut ys, mut yo, mut st) = (vec![0.0; n], vec![0.0; n], vec![0.0; d.states_len()]);
        ssd_fwd_chunked(d, &c.inputs(), &mut ys, &mut yo, &mut st).unwrap();
        let mut o = grads(d);
        let mut g = SsdGrads {
            dx: &mut o.dx,
            dbc: &mut o.dbc,
            ddt_raw: &mut o.ddt,
            ld_ddt: d.nheads,
            partials: &mut o.partials,
        };
        if chunked {
            ssd_bwd_chunked(d, &c.inputs(), &ys, &st, &c.dy, &mut g).unwrap();
        } else {
            ssd_bwd_recurrent(d, &c.inputs(), &ys, &c.dy, &mut g).unwrap();
        }
        o
    }

    fn rel(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        if a.iter().any(|v| !v.is_finite()) {
            return f64::INFINITY;
        }
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
        let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
        num / den.max(1e-300)
    }

    fn dims(batch: usize, len: usize, nheads: usize, p: usize, n: usize, g: usize, chunk: usize) -> SsdDims {
        SsdDims { batch, len, nheads, headdim: p, d_state: n, ngroups: g, chunk }
    }

    const SHAPES: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
        (2, 16, 2, 3, 4, 1, 4),
        (1, 13, 4, 4, 3, 2, 5),
        (2, 13, 2, 5, 4, 2, 4),
        (1, 7, 3, 2, 2, 3, 1),
        (1, 10, 2, 3, 5, 1, 16),
        (2, 21, 4, 4, 4, 1, 8),
    ];

    /// Chunked forward and backward equal the recurrence, at chunk lengths that divide the
    /// sequence, that do not, 1 and longer than it; with one and several groups.
    #[test]
    fn chunked_equals_recurrence() {
        for (k, &(b, l, nh, p, n, g, q)) in SHAPES.iter().enumerate() {
            let c = case(dims(b, l, nh, p, n, g, q), 11 + k as u64);
            let d = &c.dims;
            let sz = d.rows() * d.d_inner();
            let (mut y1, mut o1, mut st) = (vec![0.0; sz], vec![0.0; sz], vec![0.0; d.states_len()]);
            ssd_fwd_chunked(d, &c.inputs(), &mut y1, &mut o1, &mut st).unwrap();
            let (mut y2, mut o2) = (vec![0.0; sz], vec![0.0; sz]);
            ssd_fwd_recurrent(d, &c.inputs(), &mut y2, &mut o2).unwrap();
            assert!(rel(&y1, &y2) < 1e-12, "{d:?}: y_ssd {}", rel(&y1, &y2));
            assert!(rel(&o1, &o2) < 1e-12, "{d:?}: y_out {}", rel(&o1, &o2));
            let (a, r) = (run_bwd(&c, true), run_bwd(&c, false));
            for (what, x, y) in [
                ("dx", &a.dx, &r.dx),
                ("dbc", &a.dbc, &r.dbc),
                ("ddt", &a.ddt, &r.ddt),
                ("partials", &a.partials, &r.partials),
            ] {
                let e = rel(x, y);
                assert!(e < 1e-11, "{d:?}: {what} rel err {e}");
            }
        }
    }

    /// The chunk length changes nothing (the chunk-entry states of the last chunk and the
    /// outputs), including a chunk longer than the sequence.
    #[test]
    fn chunk_length_is_invisible() {
        let base = case(dims(1, 12, 2, 3, 4, 1, 12), 5);
        let mut outs = Vec::new();
        for q in [1, 3, 5, 12, 20] {
            let c = Case { dims: SsdDims { chunk: q, ..base.dims }, ..case(base.dims, 5) };
            outs.push(run_bwd(&c, true));
        }
        for o in &outs[1..] {
            assert!(rel(&o.dx, &outs[0].dx) < 1e-12 && rel(&o.dbc, &outs[0].dbc) < 1e-12);
            assert!(rel(&o.partials, &outs[0].partials) < 1e-11);
        }
    }

    /// `J = Σ y_out · dy` by central differences against the recurrence's gradients: x, B, C
    /// entries, `dt_raw` (through `dt = softplus(s)`), and the `A_log`, `D` and `dt_bias`
    /// sums.
    #[test]
    fn recurrent_backward_matches_finite_differences() {
        let c = case(dims(2, 9, 4, 3, 2, 2, 4), 77);
        let d = c.dims;
        let j = |xbc: &[f64], dt: &[f64], a_log: &[f64], dd: &[f64]| -> f64 {
            let inp = SsdInputs { xbc, ld_xbc: d.xbc_width(), dt, a_log, d: dd };
            let sz = d.rows() * d.d_inner();
            let (mut y, mut o) = (vec![0.0; sz], vec![0.0; sz]);
            ssd_fwd_recurrent(&d, &inp, &mut y, &mut o).unwrap();
            o.iter().zip(&c.dy).map(|(a, b)| a * b).sum()
        };
        let g = run_bwd(&c, false);
        let eps = 1e-6;
        let fd = |f: &dyn Fn(f64) -> f64| (f(eps) - f(-eps)) / (2.0 * eps);
        let close = |got: f64, want: f64, what: &str| {
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "{what}: analytic {got} vs numeric {want}");
        };
        let w = d.xbc_width();
        let di = d.d_inner();
        let n = d.d_state;
        for &(r, col) in &[(0usize, 0usize), (3, 5), (10, 11), (17, di), (12, di + 3), (5, di + 2 * n + 1), (16, w - 1)]
        {
            let want = fd(&|e| {
                let mut x = c.xbc.clone();
                x[r * w + col] += e;
                j(&x, &c.dt, &c.a_log, &c.d)
            });
            let got = if col < di {
                g.dx[r * di + col]
            } else {
                // a B or C column: the sum of its group's heads.
                let (is_c, within) =
                    if col < di + d.ngroups * n { (0, col - di) } else { (n, col - di - d.ngroups * n) };
                let (grp, k) = (within / n, within % n);
                let hpg = d.nheads / d.ngroups;
                (grp * hpg..(grp + 1) * hpg).map(|h| g.dbc[(h * d.rows() + r) * 2 * n + is_c + k]).sum()
            };
            close(got, want, &format!("xbc[{r}, {col}]"));
        }
        let softplus = |s: f64| s.max(0.0) + (-s.abs()).exp().ln_1p();
        let inv = |y: f64| y + (-(-y).exp_m1()).ln();
        for &(r, h) in &[(0usize, 0usize), (7, 3), (17, 1)] {
            let want = fd(&|e| {
                let mut dt = c.dt.clone();
                dt[r * d.nheads + h] = softplus(inv(dt[r * d.nheads + h]) + e);
                j(&c.xbc, &dt, &c.a_log, &c.d)
            });
            close(g.ddt[r * d.nheads + h], want, &format!("dt_raw[{r}, {h}]"));
        }
        let nh = d.nheads;
        let total = |k: usize, h: usize| (0..d.batch).map(|b| g.partials[b * 3 * nh + k * nh + h]).sum::<f64>();
        for h in 0..nh {
            let want = fd(&|e| {
                let dt: Vec<f64> =
                    c.dt.iter().enumerate().map(|(i, &v)| if i % nh == h { softplus(inv(v) + e) } else { v }).collect();
                j(&c.xbc, &dt, &c.a_log, &c.d)
            });
            close(total(0, h), want, &format!("dt_bias[{h}]"));
            let want = fd(&|e| {
                let mut a = c.a_log.clone();
                a[h] += e;
                j(&c.xbc, &c.dt, &a, &c.d)
            });
            close(total(1, h), want, &format!("A_log[{h}]"));
            let want = fd(&|e| {
                let mut dd = c.d.clone();
                dd[h] += e;
                j(&c.xbc, &c.dt, &c.a_log, &dd)
            });
            close(total(2, h), want, &format!("D[{h}]"));
        }
    }

    #[test]
    fn limits_and_short_buffers_are_errors() {
        assert!(dims(1, 4, 2, 65, 4, 1, 4).check("t").is_err());
        assert!(dims(1, 4, 3, 4, 4, 2, 4).check("t").is_err());
        assert!(dims(1, 4, 2, 4, 4, 1, 0).check("t").is_err());
        let c = case(dims(1, 4, 2, 4, 4, 1, 4), 1);
        let mut short = vec![0.0; 3];
        let (mut a, mut s) = (vec![0.0; 32], vec![0.0; 128]);
        assert!(ssd_fwd_chunked(&c.dims, &c.inputs(), &mut short, &mut a, &mut s).is_err());
    }
}
