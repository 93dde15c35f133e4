//! The SSD scan: the chunked ("SSD minimal") algorithm, the plain recurrence it must
//! equal, and the segment-sum decay matrices.

use candle_core::{Tensor, D};

use crate::seq::ops::Ctx;
use candle_core::Result;

/// `exp(segsum(x))` for `x [..., T]`: `L[..., i, j] = exp(Σ_{k=j+1..i} x_k)` for
/// `j ≤ i` (1 on the diagonal) and 0 above the diagonal.
///
/// Built as a masked cumulative sum, not as a difference of prefix sums, so long
/// chunks do not lose precision; the upper triangle is zeroed by a multiplicative mask
/// instead of `-inf`, which keeps infinities out of the backward pass.
pub(crate) fn segsum_exp(x: &Tensor) -> Result<Tensor> {
    let t = x.dim(D::Minus1)?;
    let dev = x.device();
    let idx_i = Tensor::arange(0u32, t as u32, dev)?.reshape((t, 1))?.broadcast_as((t, t))?;
    let idx_j = Tensor::arange(0u32, t as u32, dev)?.reshape((1, t))?.broadcast_as((t, t))?;
    let strict_lower = idx_i.gt(&idx_j)?.to_dtype(x.dtype())?;
    let lower = idx_i.ge(&idx_j)?.to_dtype(x.dtype())?;
    // xxt[..., j, i] = x[..., i] for i > j, else 0; cumulative sum over i (last axis),
    // then back to [..., i, j].
    let xxt = x.unsqueeze(D::Minus2)?.broadcast_mul(&strict_lower.t()?)?;
    let s = cumsum_last(&xxt)?.transpose(D::Minus1, D::Minus2)?;
    s.exp()?.broadcast_mul(&lower)?.contiguous()
}

/// Inclusive cumulative sum over the last axis as one 2-D matmul with an
/// upper-triangular matrix of ones (candle's `cumsum` fails on batched non-last
/// layouts), in the input's dtype.
pub(crate) fn cumsum_last(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let t = dims[dims.len() - 1];
    let rows = x.elem_count() / t.max(1);
    let dev = x.device();
    let k = Tensor::arange(0u32, t as u32, dev)?.reshape((t, 1))?.broadcast_as((t, t))?;
    let i = Tensor::arange(0u32, t as u32, dev)?.reshape((1, t))?.broadcast_as((t, t))?;
    let upper = k.le(&i)?.to_dtype(x.dtype())?; // upper[k, i] = 1 for k ≤ i
    x.contiguous()?.reshape((rows, t))?.matmul(&upper)?.reshape(dims)
}

/// Chunked SSD. `x [b, l, h, p]` (already `x·dt`), `a [b, l, h]` (already `A·dt`,
/// ≤ 0), `bm`, `cm` `[b, l, h, n]` (already expanded from groups to heads).
/// Recurrence `H_t = exp(a_t) H_{t−1} + x_t b_tᵀ`, `y_t = H_t c_t` from a zero state.
/// Returns `(y [b, l, h, p], final state [b, h, p, n])`. Sequences are zero-padded to
/// a multiple of `chunk` (padding has `a = 0`, `x = 0`: it changes nothing).
/// Matmuls run in the context's compute dtype; decays in the input dtype.
pub fn ssd_chunked(
    c: &Ctx,
    x: &Tensor,
    a: &Tensor,
    bm: &Tensor,
    cm: &Tensor,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    if chunk == 0 {
        candle_core::bail!("SSD chunk_size must be > 0");
    }
    let (bs, l, h, p) = x.dims4()?;
    let n = bm.dim(3)?;
    let pad = (chunk - l % chunk) % chunk;
    let nc = (l + pad) / chunk;
    let q = chunk;
    let x = x.pad_with_zeros(1, 0, pad)?;
    let a = a.pad_with_zeros(1, 0, pad)?;
    let bm = bm.pad_with_zeros(1, 0, pad)?;
    let cm = cm.pad_with_zeros(1, 0, pad)?;
    let x = x.reshape((bs, nc, q, h, p))?.permute((0, 3, 1, 2, 4))?.contiguous()?; // [b,h,c,Q,p]
    let bm = bm.reshape((bs, nc, q, h, n))?.permute((0, 3, 1, 2, 4))?.contiguous()?; // [b,h,c,Q,n]
    let cm = cm.reshape((bs, nc, q, h, n))?.permute((0, 3, 1, 2, 4))?.contiguous()?;
    let a = a.reshape((bs, nc, q, h))?.permute((0, 3, 1, 2))?.contiguous()?; // [b,h,c,Q]
    let a_cs = cumsum_last(&a)?;

    // 1. intra-chunk: the quadratic "attention-like" form.
    let lmat = segsum_exp(&a)?; // [b,h,c,Q,Q]
    let scores = (c.mm(&cm, &bm.transpose(3, 4)?.contiguous()?)? * lmat)?;
    let y_diag = c.mm(&scores, &x)?; // [b,h,c,Q,p]

    // 2. each chunk's own contribution to the state at its end.
    let last = a_cs.narrow(3, q - 1, 1)?; // [b,h,c,1]
    let decay_to_end = last.broadcast_sub(&a_cs)?.exp()?;
    let xd = x.broadcast_mul(&decay_to_end.unsqueeze(4)?)?;
    let chunk_states = c.mm(&xd.transpose(3, 4)?.contiguous()?, &bm)?; // [b,h,c,p,n]

    // 3. state passing across chunk boundaries.
    let init = Tensor::zeros((bs, h, 1, p, n), chunk_states.dtype(), chunk_states.device())?;
    let states = Tensor::cat(&[&init, &chunk_states], 2)?.reshape((bs, h, nc + 1, p * n))?;
    let ends = last.squeeze(3)?.pad_with_zeros(2, 1, 0)?; // [b,h,c+1]
    let chunk_decay = segsum_exp(&ends)?; // [b,h,c+1,c+1]
    let new_states = c.mm(&chunk_decay, &states)?.reshape((bs, h, nc + 1, p, n))?;
    let states_in = new_states.narrow(2, 0, nc)?; // state entering each chunk
    let final_state = new_states.narrow(2, nc, 1)?.squeeze(2)?;

    // 4. the incoming state's contribution at each position.
    let y_off = c.mm(&cm, &states_in.transpose(3, 4)?.contiguous()?)?.broadcast_mul(&a_cs.exp()?.unsqueeze(4)?)?;
    let y = (y_diag + y_off)?.permute((0, 2, 3, 1, 4))?.reshape((bs, nc * q, h, p))?.narrow(1, 0, l)?;
    Ok((y, final_state))
}

/// One step of the recurrence: `state [b, h, p, n]`, `x [b, h, p]` (already `x·dt`),
/// `a [b, h]` (already `A·dt`), `bm`, `cm` `[b, h, n]` → (`y [b, h, p]`, new state).
pub fn ssd_step(state: &Tensor, x: &Tensor, a: &Tensor, bm: &Tensor, cm: &Tensor) -> Result<(Tensor, Tensor)> {
    let decay = a.exp()?.unsqueeze(2)?.unsqueeze(3)?;
    let inject = x.unsqueeze(3)?.broadcast_mul(&bm.unsqueeze(2)?)?;
    let state = state.broadcast_mul(&decay)?.add(&inject)?;
    let y = state.broadcast_mul(&cm.unsqueeze(2)?)?.sum(3)?;
    Ok((y, state))
}

/// The plain sequential recurrence over a whole sequence (the reference the chunked
/// form is tested against). Same shapes as [`ssd_chunked`].
pub fn ssd_recurrent(x: &Tensor, a: &Tensor, bm: &Tensor, cm: &Tensor) -> Result<(Tensor, Tensor)> {
    let (bs, l, h, p) = x.dims4()?;
    let n = bm.dim(3)?;
    let mut state = Tensor::zeros((bs, h, p, n), x.dtype(), x.device())?;
    let mut ys = Vec::with_capacity(l);
    for t in 0..l {
        let (y, s) = ssd_step(
            &state,
            &x.narrow(1, t, 1)?.squeeze(1)?,
            &a.narrow(1, t, 1)?.squeeze(1)?,
            &bm.narrow(1, t, 1)?.squeeze(1)?,
            &cm.narrow(1, t, 1)?.squeeze(1)?,
        )?;
        state = s;
        ys.push(y);
    }
    Ok((Tensor::stack(&ys, 1)?, state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seq_testing::rel_err;
    use candle_core::{DType, Device, Var};
    use fx_precision::Precision;

    fn inputs(b: usize, l: usize, h: usize, p: usize, n: usize) -> (Tensor, Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f64, 1.0, (b, l, h, p), &dev).unwrap();
        // A·dt in (−1.5, 0): realistic decays, some strong.
        let a = (Tensor::rand(0f64, 1.5, (b, l, h), &dev).unwrap().neg()).unwrap();
        let bm = Tensor::randn(0f64, 1.0, (b, l, h, n), &dev).unwrap();
        let cm = Tensor::randn(0f64, 1.0, (b, l, h, n), &dev).unwrap();
        (x, a, bm, cm)
    }

    #[test]
    fn segsum_matches_definition() {
        let x = Tensor::randn(0f64, 1.0, (2, 7), &Device::Cpu).unwrap();
        let l = segsum_exp(&x).unwrap().to_vec3::<f64>().unwrap();
        let xv = x.to_vec2::<f64>().unwrap();
        for (r, m) in xv.iter().zip(&l) {
            for i in 0..7 {
                for j in 0..7 {
                    let want = if j > i { 0.0 } else { r[j + 1..=i].iter().sum::<f64>().exp() };
                    assert!((m[i][j] - want).abs() < 1e-12, "{i},{j}");
                }
            }
        }
    }

    #[test]
    fn chunked_equals_recurrence_f64() {
        let c = Ctx::with_dtype(DType::F64, false, false);
        // chunk sizes that divide L, that do not, chunk 1 and chunk > L.
        for &(l, chunk) in &[(16, 4), (13, 4), (13, 5), (7, 1), (10, 16), (21, 8)] {
            let (x, a, bm, cm) = inputs(2, l, 3, 4, 5);
            let (y1, s1) = ssd_chunked(&c, &x, &a, &bm, &cm, chunk).unwrap();
            let (y2, s2) = ssd_recurrent(&x, &a, &bm, &cm).unwrap();
            let e = rel_err(&y1, &y2);
            assert!(e < 1e-12, "L={l} chunk={chunk}: y rel err {e}");
            let e = rel_err(&s1, &s2);
            assert!(e < 1e-12, "L={l} chunk={chunk}: state rel err {e}");
        }
    }

    #[test]
    fn chunked_gradients_equal_recurrence_gradients() {
        let c = Ctx::with_dtype(DType::F64, false, true);
        let (x, a, bm, cm) = inputs(1, 11, 2, 3, 4);
        let vars: Vec<Var> = [&x, &a, &bm, &cm].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let w = Tensor::randn(0f64, 1.0, (1, 11, 2, 3), &Device::Cpu).unwrap();
        let t = |i: usize| vars[i].as_tensor();
        let (y1, _) = ssd_chunked(&c, t(0), t(1), t(2), t(3), 4).unwrap();
        let g1 = (y1 * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (y2, _) = ssd_recurrent(t(0), t(1), t(2), t(3)).unwrap();
        let g2 = (y2 * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for v in &vars {
            let e = rel_err(g1.get(v.as_tensor()).unwrap(), g2.get(v.as_tensor()).unwrap());
            assert!(e < 1e-12, "grad rel err {e}");
        }
    }

    #[test]
    fn chunked_f32_close_to_f64_recurrence() {
        let c = Ctx::inference(Precision::F32);
        let (x, a, bm, cm) = inputs(2, 29, 2, 4, 8);
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (y1, _) = ssd_chunked(&c, &f(&x), &f(&a), &f(&bm), &f(&cm), 8).unwrap();
        let (y2, _) = ssd_recurrent(&x, &a, &bm, &cm).unwrap();
        let e = rel_err(&y1, &y2);
        assert!(e < 1e-5, "f32 rel err {e}");
    }
}
