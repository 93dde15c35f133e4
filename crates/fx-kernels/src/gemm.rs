//! A row-major GEMM described on raw addresses ([`Gemm`]), the one descriptor both the
//! CUDA backend (cuBLAS, `cuda::blas::Blas::run`) and the CPU reference ([`gemm_ref`]) of the
//! fused training steps execute, so one orchestration of a model's step runs on either.

/// Element type of a [`Gemm`]'s `A` and `B` (`C` is always F32, accumulation F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmInputs {
    /// F32 inputs (no TF32: candle's and PyTorch's default).
    #[default]
    F32,
    /// BF16 inputs on the tensor cores.
    Bf16,
}

/// A row-major `C[m, n] = alpha · op(A) · op(B) + beta · C` on raw device addresses, with
/// `op(A)` `[m, k]` and `op(B)` `[k, n]`: `A` is stored `[k, m]` when `ta`, `B` `[n, k]` when
/// `tb`; `lda`/`ldb`/`ldc` are the stored matrices' row strides in elements. With
/// `batch > 1`, entry `i` reads `A + i·stride_a`, `B + i·stride_b` and writes `C + i·stride_c`
/// (strides in elements, 0 to share one matrix). Start from [`Gemm::new`] and set what differs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub beta: f32,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
    pub batch: usize,
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub inputs: GemmInputs,
}

impl Gemm {
    /// `C[m, n] = op(A) op(B)` with dense row strides (`lda` = stored A's width, ...), alpha 1,
    /// beta 0, one matrix, F32 inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn new(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: u64, b: u64, c: u64) -> Self {
        Self {
            ta,
            tb,
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            a,
            lda: if ta { m } else { k },
            b,
            ldb: if tb { k } else { n },
            c,
            ldc: n,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            inputs: GemmInputs::F32,
        }
    }

    /// The same GEMM accumulating into `C` (`beta = 1`).
    pub fn accumulate(self) -> Self {
        Self { beta: 1.0, ..self }
    }

    /// The same GEMM as a batch of `batch` with the given element strides.
    pub fn batched(self, batch: usize, stride_a: usize, stride_b: usize, stride_c: usize) -> Self {
        Self { batch, stride_a: stride_a as i64, stride_b: stride_b as i64, stride_c: stride_c as i64, ..self }
    }

    /// The same GEMM reading BF16 `A` and `B` at the given addresses (same strides).
    pub fn bf16(self, a16: u64, b16: u64) -> Self {
        Self { a: a16, b: b16, inputs: GemmInputs::Bf16, ..self }
    }
}

/// Runs `g` on the CPU, reading host memory at its addresses: the reference of
/// `cuda::blas::Blas::run` (f64 accumulation; BF16 inputs are read as `half::bf16`). With
/// `beta == 0` the old `C` is never read (it may hold anything, NaN included), as cuBLAS.
///
/// # Safety
/// Every matrix `g` describes (each batch entry at its stride) must lie in live host memory
/// holding the element type `g.inputs` names (F32 for `C`), with `C` not overlapping `A` or `B`.
pub unsafe fn gemm_ref(g: &Gemm) {
    let load = |base: u64, idx: usize| -> f64 {
        match g.inputs {
            GemmInputs::F32 => unsafe { *(base as *const f32).add(idx) as f64 },
            GemmInputs::Bf16 => unsafe { half::bf16::from_bits(*(base as *const u16).add(idx)).to_f64() },
        }
    };
    let esize: i64 = match g.inputs {
        GemmInputs::F32 => 4,
        GemmInputs::Bf16 => 2,
    };
    for bi in 0..g.batch.max(1) as i64 {
        let a = (g.a as i64 + bi * g.stride_a * esize) as u64;
        let b = (g.b as i64 + bi * g.stride_b * esize) as u64;
        let c = (g.c as i64 + bi * g.stride_c * 4) as u64 as *mut f32;
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0f64;
                for p in 0..g.k {
                    let av = if g.ta { load(a, p * g.lda + i) } else { load(a, i * g.lda + p) };
                    let bv = if g.tb { load(b, j * g.ldb + p) } else { load(b, p * g.ldb + j) };
                    acc += av * bv;
                }
                let out = unsafe { c.add(i * g.ldc + j) };
                let old = if g.beta == 0.0 { 0.0 } else { (unsafe { *out as f64 }) * g.beta as f64 };
                unsafe { *out = (g.alpha as f64 * acc + old) as f32 };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_gemm_handles_transposes_strides_batches_and_beta() {
        // A [2, 3], B [3, 2] stored transposed ([2, 3]), two batch entries; C accumulates.
        let a: Vec<f32> = vec![1., 2., 3., 4., 5., 6., /* batch 1 */ 0., 1., 0., 1., 0., 1.];
        let bt: Vec<f32> = vec![1., 0., 2., 0., 1., 1.]; // B = [[1,0],[0,1],[2,1]], shared
        let mut c = vec![10f32; 8];
        let g = Gemm::new(false, true, 2, 2, 3, a.as_ptr() as u64, bt.as_ptr() as u64, c.as_mut_ptr() as u64)
            .batched(2, 6, 0, 4)
            .accumulate();
        unsafe { gemm_ref(&g) };
        // batch 0: [[1+6, 2+3], [4+12, 5+6]] + 10; batch 1: [[0, 1], [1+2, 1]] + 10.
        assert_eq!(&c[..4], &[17., 15., 26., 21.]);
        assert_eq!(&c[4..], &[10., 11., 13., 11.]);
        // beta 0 never reads C: NaN there does not leak.
        let mut c2 = vec![f32::NAN; 4];
        let g2 = Gemm::new(
            true,
            false,
            2,
            2,
            1,
            [1f32, 2.].as_ptr() as u64,
            [3f32, 4.].as_ptr() as u64,
            c2.as_mut_ptr() as u64,
        );
        unsafe { gemm_ref(&g2) };
        assert_eq!(c2, vec![3., 4., 6., 8.]);
    }
}
