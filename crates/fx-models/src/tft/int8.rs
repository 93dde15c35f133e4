//! The INT8 variable selection of a TFT forecast: a variable selection network's `n`
//! per-variable GRNs and their selection mix in one pass, INT8 between the layers
//! (`kernels/tft/tft_int8.cu`, `cuda::tft_int8` on the GPU; [`vsn_vars_i8_ref`] here is its
//! reference).
//!
//! Op by op, a forecast's encoder writes and re-reads `[n, rows, d]` F32 activations between
//! GEMMs and element-wise kernels (55 variables × 16,384 rows × 128 at batch 256: ~460 MB per
//! buffer); one pass over a tile of rows keeps them on the chip. Two facts make it small:
//! - a variable's input is its scalar embedding `raw · w_emb + b_emb`, so its GRN's first
//!   layer is `ELU(raw · u1 + c1)` with `u1 = W1 · w_emb`, `c1 = W1 · b_emb + b1`
//!   ([`fold_embedding`], in f64 on the host): no GEMM, and no quantisation error there;
//! - `fc4` and `fc5` read the same input, quantised once.
//!
//! Per row `r` and variable `j` (all F32 unless said otherwise; through step 4 and `z` each
//! product and sum is rounded as written, as the kernel does with its `_rn` intrinsics; the
//! LayerNorm's and the mix's sums in steps 5–6 run in another order on the GPU, so those
//! agree within F32 rounding, not to the bit):
//! 1. `a1 = ELU(raw[r, j] · u1[j] + c1[j])`;
//! 2. `q1 = clamp(round_half_even(a1 / s1), ±127)` with `s1` the calibrated step `in2[j]`,
//!    or under dynamic scales the row's `max |a1| / 127` (1 for an all-zero row); the
//!    division is a multiplication by `1 / s1`;
//! 3. `a2[o] = (Σ q1 · W2[j][o]) · (ws2[j][o] · s1) + b2[j][o]`, the sum exact in i32;
//! 4. `q2` from `a2` as in 2 (step `in45[j]`, or dynamic), then `g4`, `g5` as in 3 from
//!    `W4[j]`, `W5[j]`;
//! 5. `z = (raw[r, j] · w_emb[j] + b_emb[j]) + σ(g4) ⊙ g5`, LayerNorm'd with the variable's
//!    `ln_w[j]`, `ln_b[j]`;
//! 6. `out[r] = Σ_j wsel[r, j] · LN_j(z)` in variable order.

use crate::tft::ops::{elu, sigmoid, Addr};
use fx_kernels::{Error, Result};

/// Widest `d` the kernel takes (its shared tiles hold `d × d` INT8 weights).
pub const VSN_I8_MAX_D: usize = 128;

/// The arguments of one INT8 variable selection: `raw [rows, n]`; `emb_w`, `emb_b`, `u1`,
/// `c1`, the weight steps `ws2`, `ws4`, `ws5`, the biases `b2`, `b4`, `b5` and the norms
/// `ln_w`, `ln_b` `[n, d]` F32; the weights `w2`, `w4`, `w5` `[n, d, d]` I8 (each variable's
/// `[out, in]`); the calibrated input steps `in2`, `in45` `[n]`, or both 0 for dynamic
/// scales; `wsel [rows, n]`; `out [rows, d]` (written). See the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VsnVarsI8 {
    pub rows: usize,
    pub n: usize,
    pub d: usize,
    pub raw: Addr,
    pub emb_w: Addr,
    pub emb_b: Addr,
    pub u1: Addr,
    pub c1: Addr,
    pub w2: Addr,
    pub w4: Addr,
    pub w5: Addr,
    pub ws2: Addr,
    pub ws4: Addr,
    pub ws5: Addr,
    pub b2: Addr,
    pub b4: Addr,
    pub b5: Addr,
    pub in2: Addr,
    pub in45: Addr,
    pub ln_w: Addr,
    pub ln_b: Addr,
    pub eps: f32,
    pub wsel: Addr,
    pub out: Addr,
}

impl VsnVarsI8 {
    /// Checks the sizes the kernel takes: `d` a multiple of 4 up to [`VSN_I8_MAX_D`], at
    /// least one row and variable, rows below 2³², both input steps given or neither.
    pub fn check(&self, context: &'static str) -> Result<()> {
        if self.d == 0 || !self.d.is_multiple_of(4) || self.d > VSN_I8_MAX_D {
            return Err(Error::Unsupported {
                context,
                message: format!("d = {} (a multiple of 4 up to {VSN_I8_MAX_D})", self.d),
            });
        }
        if self.rows == 0 || self.n == 0 || u32::try_from(self.rows).is_err() || u32::try_from(self.n).is_err() {
            return Err(Error::shape(
                "rows × variables",
                context,
                "1..2^32 each",
                format!("{} × {}", self.rows, self.n),
            ));
        }
        if (self.in2 == 0) != (self.in45 == 0) {
            return Err(Error::Config { context, message: "one calibrated input step given without the other".into() });
        }
        Ok(())
    }
}

/// `clamp(round_half_even(x · inv), ±127)`: the one rounding rule for INT8 activations
/// (fx-quant's policies and TFT, and this kernel).
#[inline(always)]
// `max`/`min` compile to vector min/max; inputs are checked finite by the callers.
#[allow(clippy::manual_clamp)]
pub fn quantize_activation(x: f32, inv: f32) -> i8 {
    (x * inv).round_ties_even().max(-127.0).min(127.0) as i8
}

/// One variable selection network's INT8 form, on the host: what [`VsnVarsI8`] points at
/// besides the rows' inputs and output (`[n, d]` F32 unless said otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct VsnI8Weights {
    pub n: usize,
    pub d: usize,
    pub eps: f32,
    pub emb_w: Vec<f32>,
    pub emb_b: Vec<f32>,
    /// The folded fc1 ([`fold_embedding`] per variable).
    pub u1: Vec<f32>,
    pub c1: Vec<f32>,
    /// fc2, fc4, fc5: `[n, d, d]` I8, each variable's `[out, in]`.
    pub w: [Vec<i8>; 3],
    /// Their per-row steps.
    pub ws: [Vec<f32>; 3],
    /// Their biases.
    pub b: [Vec<f32>; 3],
    /// Calibrated input steps `[n]` of fc2 and of fc4 = fc5, or `None` for dynamic scales.
    pub input_steps: Option<(Vec<f32>, Vec<f32>)>,
    pub ln_w: Vec<f32>,
    pub ln_b: Vec<f32>,
}

impl VsnI8Weights {
    /// Checks every length against `n`, `d` (the kernel's: `d` a multiple of 4 up to
    /// [`VSN_I8_MAX_D`]) and every value for finiteness (steps > 0).
    pub fn check(&self, context: &'static str) -> Result<()> {
        let (n, d) = (self.n, self.d);
        self.host_args(1, 0, 0, 0).check(context)?;
        let nd = n * d;
        let mut f: Vec<(&str, &[f32], usize)> = vec![
            ("emb_w", &self.emb_w, nd),
            ("emb_b", &self.emb_b, nd),
            ("u1", &self.u1, nd),
            ("c1", &self.c1, nd),
            ("ln_w", &self.ln_w, nd),
            ("ln_b", &self.ln_b, nd),
        ];
        for m in 0..3 {
            f.push(("weight steps", &self.ws[m], nd));
            f.push(("biases", &self.b[m], nd));
        }
        if let Some((a, b)) = &self.input_steps {
            f.push(("input steps", a, n));
            f.push(("input steps", b, n));
        }
        for (what, v, len) in f {
            if v.len() != len {
                return Err(Error::shape("INT8 variable selection", context, format!("{what}: {len} values"), v.len()));
            }
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(Error::Config {
                    context,
                    message: format!("INT8 variable selection {what}: the value {x}"),
                });
            }
        }
        if let Some(w) = self.w.iter().find(|w| w.len() != nd * d) {
            return Err(Error::shape("INT8 variable selection weights", context, nd * d, w.len()));
        }
        let steps = self.ws.iter().flatten().chain(self.input_steps.iter().flat_map(|(a, b)| a.iter().chain(b)));
        // Finite (checked above), so `<= 0` is every step that is not > 0.
        if let Some(s) = steps.into_iter().find(|s| **s <= 0.0) {
            return Err(Error::Config {
                context,
                message: format!("INT8 variable selection: the step {s} (must be > 0)"),
            });
        }
        Ok(())
    }

    /// The arguments for `rows` rows at `raw`, `wsel`, `out` with these weights at their
    /// host addresses (for [`vsn_vars_i8_ref`]).
    pub fn host_args(&self, rows: usize, raw: Addr, wsel: Addr, out: Addr) -> VsnVarsI8 {
        let a = |v: &[f32]| v.as_ptr() as Addr;
        let (in2, in45) = match &self.input_steps {
            Some((x, y)) => (a(x), a(y)),
            None => (0, 0),
        };
        VsnVarsI8 {
            rows,
            n: self.n,
            d: self.d,
            raw,
            emb_w: a(&self.emb_w),
            emb_b: a(&self.emb_b),
            u1: a(&self.u1),
            c1: a(&self.c1),
            w2: self.w[0].as_ptr() as Addr,
            w4: self.w[1].as_ptr() as Addr,
            w5: self.w[2].as_ptr() as Addr,
            ws2: a(&self.ws[0]),
            ws4: a(&self.ws[1]),
            ws5: a(&self.ws[2]),
            b2: a(&self.b[0]),
            b4: a(&self.b[1]),
            b5: a(&self.b[2]),
            in2,
            in45,
            ln_w: a(&self.ln_w),
            ln_b: a(&self.ln_b),
            eps: self.eps,
            wsel,
            out,
        }
    }

    /// The reference ([`vsn_vars_i8_ref`]) over `raw [rows, n]` and `wsel [rows, n]`:
    /// `out [rows, d]`.
    pub fn forward_ref(&self, raw: &[f32], wsel: &[f32]) -> Result<Vec<f32>> {
        const CTX: &str = "VsnI8Weights::forward_ref";
        self.check(CTX)?;
        let rows = raw.len() / self.n.max(1);
        if raw.len() != rows * self.n || wsel.len() != raw.len() {
            return Err(Error::shape(
                "raw, wsel",
                CTX,
                format!("[rows, {}] each", self.n),
                format!("{}, {}", raw.len(), wsel.len()),
            ));
        }
        let mut out = vec![0f32; rows * self.d];
        let args = self.host_args(rows, raw.as_ptr() as Addr, wsel.as_ptr() as Addr, out.as_mut_ptr() as Addr);
        // SAFETY: every address is one of the live, checked vectors above.
        unsafe { vsn_vars_i8_ref(&args) }?;
        Ok(out)
    }
}

/// Folds a scalar-per-variable embedding into the Linear after it: for `W [out, n · d]`
/// (variable `j`'s inputs at columns `j·d ..`), `emb_w`, `emb_b [n, d]` and `bias [out]`,
/// returns `u [out, n]` and `c [out]` with `W · emb(raw) + bias = u · raw + c` for every
/// `raw [n]`, summed in f64.
pub fn fold_embedding(
    w: &[f32],
    out: usize,
    n: usize,
    d: usize,
    emb_w: &[f32],
    emb_b: &[f32],
    bias: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    const CTX: &str = "fold_embedding";
    if w.len() != out * n * d || emb_w.len() != n * d || emb_b.len() != n * d || bias.len() != out {
        return Err(Error::shape(
            "weights",
            CTX,
            format!("[{out}, {n}·{d}], [{n}, {d}] ×2, [{out}]"),
            format!("{}, {}, {}, {}", w.len(), emb_w.len(), emb_b.len(), bias.len()),
        ));
    }
    let mut u = vec![0f32; out * n];
    let mut c = vec![0f32; out];
    for o in 0..out {
        let mut co = f64::from(bias[o]);
        for j in 0..n {
            let (mut uj, row) = (0f64, &w[(o * n + j) * d..(o * n + j + 1) * d]);
            for (k, &wv) in row.iter().enumerate() {
                uj += f64::from(wv) * f64::from(emb_w[j * d + k]);
                co += f64::from(wv) * f64::from(emb_b[j * d + k]);
            }
            u[o * n + j] = uj as f32;
        }
        c[o] = co as f32;
    }
    Ok((u, c))
}

#[inline]
unsafe fn rd(a: Addr, i: usize) -> f32 {
    unsafe { *(a as *const f32).add(i) }
}

#[inline]
unsafe fn rd8(a: Addr, i: usize) -> i32 {
    i32::from(unsafe { *(a as *const i8).add(i) })
}

/// Quantises `x` with the calibrated step `fixed` (> 0) or the row's own; returns the step.
fn quantize(x: &[f32], fixed: f32, q: &mut [i8]) -> f32 {
    let step = if fixed > 0.0 {
        fixed
    } else {
        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        if m > 0.0 {
            m / 127.0
        } else {
            1.0
        }
    };
    let inv = 1.0 / step;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = quantize_activation(v, inv);
    }
    step
}

/// `y[o] = (Σ_k q[k] · W[o, k]) · (ws[o] · s) + b[o]` for `W` at `w` (`[d, d]` I8), `ws`, `b`
/// at element offset `off`.
unsafe fn dense(q: &[i8], w: Addr, ws: Addr, b: Addr, off: usize, s: f32, y: &mut [f32]) {
    let d = q.len();
    for (o, yo) in y.iter_mut().enumerate() {
        let mut acc = 0i32;
        for (k, &qk) in q.iter().enumerate() {
            acc += i32::from(qk) * unsafe { rd8(w, off * d + o * d + k) };
        }
        *yo = acc as f32 * (unsafe { rd(ws, off + o) } * s) + unsafe { rd(b, off + o) };
    }
}

/// The reference of the INT8 variable selection (module docs), on host memory.
///
/// # Safety
/// `a`'s addresses are host buffers of the sizes [`VsnVarsI8`] states.
pub unsafe fn vsn_vars_i8_ref(a: &VsnVarsI8) -> Result<()> {
    a.check("vsn_vars_i8_ref")?;
    let (n, d) = (a.n, a.d);
    let (mut a1, mut a2, mut g4, mut g5, mut z) =
        (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
    let mut q = vec![0i8; d];
    let mut acc = vec![0f32; d];
    for r in 0..a.rows {
        acc.fill(0.0);
        for j in 0..n {
            let jd = j * d;
            let x = unsafe { rd(a.raw, r * n + j) };
            for k in 0..d {
                a1[k] = elu(x * unsafe { rd(a.u1, jd + k) } + unsafe { rd(a.c1, jd + k) });
            }
            let fixed = |s: Addr| if s == 0 { 0.0 } else { unsafe { rd(s, j) } };
            let s1 = quantize(&a1, fixed(a.in2), &mut q);
            unsafe { dense(&q, a.w2, a.ws2, a.b2, jd, s1, &mut a2) };
            let s2 = quantize(&a2, fixed(a.in45), &mut q);
            unsafe {
                dense(&q, a.w4, a.ws4, a.b4, jd, s2, &mut g4);
                dense(&q, a.w5, a.ws5, a.b5, jd, s2, &mut g5);
            }
            for k in 0..d {
                let e = x * unsafe { rd(a.emb_w, jd + k) } + unsafe { rd(a.emb_b, jd + k) };
                z[k] = e + sigmoid(g4[k]) * g5[k];
            }
            let mean = z.iter().sum::<f32>() / d as f32;
            let var = z.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let rstd = 1.0 / (var + a.eps).sqrt();
            let wj = unsafe { rd(a.wsel, r * n + j) };
            for k in 0..d {
                acc[k] += wj * ((z[k] - mean) * rstd * unsafe { rd(a.ln_w, jd + k) } + unsafe { rd(a.ln_b, jd + k) });
            }
        }
        for (k, &v) in acc.iter().enumerate() {
            unsafe { *(a.out as *mut f32).add(r * d + k) = v };
        }
    }
    Ok(())
}

/// Random inputs of a [`VsnVarsI8`] on the host (tests here and on the device): F32 weights
/// as a model holds them, and their INT8 form.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// The F32 parameters of `n` variables' GRNs (`d → d`), embeddings and norms.
    pub(crate) struct VsnF32 {
        pub n: usize,
        pub d: usize,
        pub emb_w: Vec<f32>,
        pub emb_b: Vec<f32>,
        pub w: [Vec<f32>; 4],
        pub b: [Vec<f32>; 4],
        pub ln_w: Vec<f32>,
        pub ln_b: Vec<f32>,
    }

    /// A deterministic uniform stream in `[-scale, scale)` (SplitMix64).
    pub(crate) fn uniform(len: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..len as u64)
            .map(|i| {
                let z = fx_kernels::rng::mix(seed.wrapping_mul(0x9E37_79B9).wrapping_add(i));
                ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    impl VsnF32 {
        pub(crate) fn random(n: usize, d: usize, seed: u64) -> Self {
            let ws = 1.0 / (d as f32).sqrt();
            let u = |k: u64, len: usize, s: f32| uniform(len, seed.wrapping_add(k), s);
            Self {
                n,
                d,
                emb_w: u(1, n * d, 1.0),
                emb_b: u(2, n * d, 0.5),
                w: [u(3, n * d * d, ws), u(4, n * d * d, ws), u(5, n * d * d, ws), u(6, n * d * d, ws)],
                b: [u(7, n * d, 0.1), u(8, n * d, 0.1), u(9, n * d, 0.1), u(10, n * d, 0.1)],
                ln_w: uniform(n * d, seed.wrapping_add(11), 0.2).iter().map(|v| 1.0 + v).collect(),
                ln_b: u(12, n * d, 0.1),
            }
        }

        /// The INT8 form: per-row symmetric weights, folded fc1, the given input steps.
        pub(crate) fn int8(&self, input_steps: Option<(Vec<f32>, Vec<f32>)>) -> VsnI8Weights {
            let (n, d) = (self.n, self.d);
            let quant = |m: usize| {
                let mut q = Vec::with_capacity(self.w[m].len());
                let mut s = Vec::new();
                for row in self.w[m].chunks_exact(d) {
                    let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let step = if max > 0.0 { max / 127.0 } else { 1.0 };
                    q.extend(row.iter().map(|&v| (v / step).round_ties_even().clamp(-127.0, 127.0) as i8));
                    s.push(step);
                }
                (q, s)
            };
            let (mut u1, mut c1) = (Vec::new(), Vec::new());
            for j in 0..n {
                let sl = |v: &[f32]| v[j * d..(j + 1) * d].to_vec();
                let w1 = &self.w[0][j * d * d..(j + 1) * d * d];
                let (u, c) =
                    fold_embedding(w1, d, 1, d, &sl(&self.emb_w), &sl(&self.emb_b), &sl(&self.b[0])).expect("shapes");
                u1.extend(u);
                c1.extend(c);
            }
            let ((w2, s2), (w4, s4), (w5, s5)) = (quant(1), quant(2), quant(3));
            VsnI8Weights {
                n,
                d,
                eps: 1e-5,
                emb_w: self.emb_w.clone(),
                emb_b: self.emb_b.clone(),
                u1,
                c1,
                w: [w2, w4, w5],
                ws: [s2, s4, s5],
                b: [self.b[1].clone(), self.b[2].clone(), self.b[3].clone()],
                input_steps,
                ln_w: self.ln_w.clone(),
                ln_b: self.ln_b.clone(),
            }
        }

        /// The F32 variable selection in f64 (embedding, fc1 on it, ELU, fc2, GLU, norm, mix).
        pub(crate) fn forward_f64(&self, raw: &[f32], wsel: &[f32], eps: f64) -> Vec<f64> {
            let (n, d) = (self.n, self.d);
            let rows = raw.len() / n;
            let lin = |m: usize, j: usize, x: &[f64]| -> Vec<f64> {
                (0..d)
                    .map(|o| {
                        let w = &self.w[m][(j * d + o) * d..(j * d + o + 1) * d];
                        f64::from(self.b[m][j * d + o]) + w.iter().zip(x).map(|(&a, b)| f64::from(a) * b).sum::<f64>()
                    })
                    .collect()
            };
            let mut out = vec![0f64; rows * d];
            for r in 0..rows {
                for j in 0..n {
                    let x = f64::from(raw[r * n + j]);
                    let e: Vec<f64> = (0..d)
                        .map(|k| x * f64::from(self.emb_w[j * d + k]) + f64::from(self.emb_b[j * d + k]))
                        .collect();
                    let a1: Vec<f64> =
                        lin(0, j, &e).into_iter().map(|v| if v < 0.0 { v.exp() - 1.0 } else { v }).collect();
                    let a2 = lin(1, j, &a1);
                    let (g4, g5) = (lin(2, j, &a2), lin(3, j, &a2));
                    let z: Vec<f64> = (0..d).map(|k| e[k] + g5[k] / (1.0 + (-g4[k]).exp())).collect();
                    let mean = z.iter().sum::<f64>() / d as f64;
                    let var = z.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                    let wj = f64::from(wsel[r * n + j]);
                    for k in 0..d {
                        let y = (z[k] - mean) / (var + eps).sqrt() * f64::from(self.ln_w[j * d + k])
                            + f64::from(self.ln_b[j * d + k]);
                        out[r * d + k] += wj * y;
                    }
                }
            }
            out
        }
    }

    /// Selection weights: a softmax over each row's `n` variables.
    pub(crate) fn selection(rows: usize, n: usize, seed: u64) -> Vec<f32> {
        let logits = uniform(rows * n, seed, 2.0);
        logits
            .chunks_exact(n)
            .flat_map(|row| {
                let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = row.iter().map(|v| (v - m).exp()).collect();
                let s: f32 = e.iter().sum();
                e.into_iter().map(move |v| v / s)
            })
            .collect()
    }

    /// Relative RMS of `got` against `want`.
    pub(crate) fn rel_rms(got: &[f32], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(&g, w)| (f64::from(g) - w).powi(2)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den.max(1e-30)).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    fn run_ref(p: &VsnF32, raw: &[f32], wsel: &[f32], steps: Option<(Vec<f32>, Vec<f32>)>) -> Vec<f32> {
        p.int8(steps).forward_ref(raw, wsel).expect("valid weights")
    }

    /// A fresh seed, or `FX_TEST_SEED` to replay a failure's.
    fn seed() -> u64 {
        fx_hw::test_seed(concat!(module_path!(), ":", line!()))
    }

    #[test]
    fn folded_embedding_gives_the_linear_of_the_embedding() {
        let s = seed();
        let (out, n, d) = (7, 3, 8);
        let (w, ew, eb, b) = (
            uniform(out * n * d, s, 0.5),
            uniform(n * d, s + 1, 1.0),
            uniform(n * d, s + 2, 1.0),
            uniform(out, s + 3, 0.3),
        );
        let (u, c) = fold_embedding(&w, out, n, d, &ew, &eb, &b).expect("shapes");
        let raw = uniform(n, s + 4, 3.0);
        for o in 0..out {
            let direct: f64 = f64::from(b[o])
                + (0..n * d)
                    .map(|i| {
                        f64::from(w[o * n * d + i]) * (f64::from(raw[i / d]) * f64::from(ew[i]) + f64::from(eb[i]))
                    })
                    .sum::<f64>();
            let folded: f64 =
                f64::from(c[o]) + (0..n).map(|j| f64::from(u[o * n + j]) * f64::from(raw[j])).sum::<f64>();
            assert!((direct - folded).abs() < 1e-5 * (1.0 + direct.abs()), "seed {s}, row {o}: {direct} vs {folded}");
        }
        assert!(fold_embedding(&w, out, n, d + 1, &ew, &eb, &b).unwrap_err().to_string().contains("fold_embedding"));
    }

    #[test]
    fn int8_variable_selection_tracks_the_f32_one() {
        let s = seed();
        for (n, d, rows) in [(5, 32, 37), (3, 128, 9), (2, 4, 5)] {
            let p = VsnF32::random(n, d, s);
            let raw = uniform(rows * n, s + 100, 2.0);
            let wsel = selection(rows, n, s + 200);
            let want = p.forward_f64(&raw, &wsel, 1e-5);
            let dynamic = run_ref(&p, &raw, &wsel, None);
            assert!(dynamic.iter().all(|v| v.is_finite()), "seed {s}: non-finite output");
            let e = rel_rms(&dynamic, &want);
            assert!(e < 0.02, "seed {s}, n {n} d {d}: dynamic INT8 {e:.4} from F32");
            // Calibrated steps wide enough for every input: close too; far too narrow: not.
            // (At d = 4 both are left out: a fixed 0.05 step is about the size of the small
            // rows' activations, so a 4-wide LayerNorm of them lands near F32 or not by the
            // draw (seed 1796610222279591765: 0.149), and a saturated input can land near
            // F32 by chance.)
            if d >= 32 {
                let wide = Some((vec![0.05; n], vec![0.05; n]));
                let e = rel_rms(&run_ref(&p, &raw, &wsel, wide), &want);
                assert!(e < 0.05, "seed {s}, n {n} d {d}: calibrated INT8 {e:.4} from F32");
                let narrow = Some((vec![1e-4; n], vec![1e-4; n]));
                let e = rel_rms(&run_ref(&p, &raw, &wsel, narrow), &want);
                assert!(e > 0.05, "seed {s}, n {n} d {d}: saturated steps should not track F32 ({e:.4})");
            }
        }
    }

    #[test]
    fn sizes_beyond_the_kernel_are_refused_in_one_line() {
        let base = VsnVarsI8 {
            rows: 1,
            n: 1,
            d: 8,
            raw: 0,
            emb_w: 0,
            emb_b: 0,
            u1: 0,
            c1: 0,
            w2: 0,
            w4: 0,
            w5: 0,
            ws2: 0,
            ws4: 0,
            ws5: 0,
            b2: 0,
            b4: 0,
            b5: 0,
            in2: 0,
            in45: 0,
            ln_w: 0,
            ln_b: 0,
            eps: 1e-5,
            wsel: 0,
            out: 0,
        };
        assert!(base.check("t").is_ok());
        for bad in [
            VsnVarsI8 { d: 6, ..base },
            VsnVarsI8 { d: 132, ..base },
            VsnVarsI8 { rows: 0, ..base },
            VsnVarsI8 { in2: 8, ..base },
        ] {
            let e = bad.check("t").unwrap_err().to_string();
            assert!(!e.contains('\n') && e.contains('t'), "{e}");
        }
    }

    #[test]
    fn quantize_activation_rounds_half_to_even_and_saturates() {
        assert_eq!(quantize_activation(2.5, 1.0), 2);
        assert_eq!(quantize_activation(3.5, 1.0), 4);
        assert_eq!(quantize_activation(-2.5, 1.0), -2);
        assert_eq!(quantize_activation(1e9, 1.0), 127);
        assert_eq!(quantize_activation(-1e9, 1.0), -127);
    }
}
