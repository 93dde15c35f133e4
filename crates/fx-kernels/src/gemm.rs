//! A row-major GEMM described on raw addresses ([`Gemm`]), the one descriptor both the
//! CUDA backend (cuBLAS, `cuda::blas::Blas::run`) and the CPU reference ([`gemm_ref`]) of the
//! fused training steps execute, so one orchestration of a model's step runs on either.

/// Element type of a [`Gemm`]'s `A` and `B` (accumulation is always F32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GemmInputs {
    /// F32 inputs (no TF32: candle's and PyTorch's default).
    #[default]
    F32,
    /// BF16 inputs on the tensor cores.
    Bf16,
}

/// Element type of what a [`Gemm`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GemmOutput {
    /// F32 `C`.
    #[default]
    F32,
    /// BF16 `C` (rounded to nearest even from the F32 result): the next layer's GEMM input
    /// under BF16 compute, written by the GEMM itself instead of a separate pass.
    Bf16,
}

/// A row-major `C[m, n] = alpha · op(A) · op(B) + beta · C` on raw device addresses, with
/// `op(A)` `[m, k]` and `op(B)` `[k, n]`: `A` is stored `[k, m]` when `ta`, `B` `[n, k]` when
/// `tb`; `lda`/`ldb`/`ldc` are the stored matrices' row strides in elements. With
/// `batch > 1`, entry `i` reads `A + i·stride_a`, `B + i·stride_b` and writes `C + i·stride_c`
/// (strides in elements, 0 to share one matrix). An epilogue ([`Gemm::bias_relu`]) adds an
/// F32 bias of `n` values (entry `i`'s at `bias + i·stride_bias`) to every row and applies
/// ReLU before `C` is written, in F32 or BF16 ([`Gemm::bf16_out`]); on CUDA such a GEMM runs
/// through cuBLASLt. Start from [`Gemm::new`] and set what differs.
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
    /// F32 bias `[n]` added to every row of the product (0: none).
    pub bias: u64,
    /// Element stride between batch entries' biases.
    pub stride_bias: i64,
    /// ReLU after the bias.
    pub relu: bool,
    /// Element type of `C`.
    pub output: GemmOutput,
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
            bias: 0,
            stride_bias: 0,
            relu: false,
            output: GemmOutput::F32,
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

    /// The same GEMM with the epilogue `C = act(alpha · op(A) op(B) + beta · C + bias)`:
    /// `bias` holds `n` F32 values a batch entry, `stride_bias` elements apart; `act` is ReLU
    /// when `relu`, else the identity.
    pub fn bias_relu(self, bias: u64, stride_bias: usize, relu: bool) -> Self {
        Self { bias, stride_bias: stride_bias as i64, relu, ..self }
    }

    /// The same GEMM writing a BF16 `C` at `c16` (`ldc` and `stride_c` in its elements).
    pub fn bf16_out(self, c16: u64) -> Self {
        Self { c: c16, output: GemmOutput::Bf16, ..self }
    }

    /// Whether the GEMM has an epilogue (bias, ReLU; on CUDA: a cuBLASLt call). A BF16
    /// output alone is not one: cuBLAS writes it.
    pub fn has_epilogue(&self) -> bool {
        self.bias != 0 || self.relu
    }
}

/// Runs `g` on the CPU, reading host memory at its addresses: the reference of
/// `cuda::blas::Blas::run` (f64 accumulation; BF16 inputs are read as `half::bf16`). With
/// `beta == 0` the old `C` is never read (it may hold anything, NaN included), as cuBLAS. The
/// epilogue (bias, ReLU) is applied in f64 and the result rounded once to `C`'s type.
///
/// # Safety
/// Every matrix `g` describes (each batch entry at its stride) must lie in live host memory
/// holding the element types `g.inputs` and `g.output` name (an F32 bias of `n` values an entry
/// when `g.bias` is set), with `C` not overlapping `A`, `B` or the bias.
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
        let c_size: i64 = match g.output {
            GemmOutput::F32 => 4,
            GemmOutput::Bf16 => 2,
        };
        let c = (g.c as i64 + bi * g.stride_c * c_size) as u64;
        let bias = (g.bias as i64 + bi * g.stride_bias * 4) as u64 as *const f32;
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0f64;
                for p in 0..g.k {
                    let av = if g.ta { load(a, p * g.lda + i) } else { load(a, i * g.lda + p) };
                    let bv = if g.tb { load(b, j * g.ldb + p) } else { load(b, p * g.ldb + j) };
                    acc += av * bv;
                }
                let at = i * g.ldc + j;
                let old = match (g.beta == 0.0, g.output) {
                    (true, _) => 0.0,
                    (false, GemmOutput::F32) => unsafe { *(c as *const f32).add(at) as f64 },
                    (false, GemmOutput::Bf16) => unsafe { half::bf16::from_bits(*(c as *const u16).add(at)).to_f64() },
                };
                let mut v = g.alpha as f64 * acc + old * g.beta as f64;
                if g.bias != 0 {
                    v += unsafe { *bias.add(j) } as f64;
                }
                if g.relu {
                    v = v.max(0.0);
                }
                match g.output {
                    GemmOutput::F32 => unsafe { *(c as *mut f32).add(at) = v as f32 },
                    GemmOutput::Bf16 => unsafe { *(c as *mut u16).add(at) = half::bf16::from_f64(v).to_bits() },
                }
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

    #[test]
    fn reference_epilogue_adds_each_entrys_bias_then_relu_and_rounds_once_to_bf16() {
        // A [2, 2] per entry, B = I shared, bias [2] per entry: C = relu(A + bias).
        let a: Vec<f32> = vec![1., -2., 3., 0.5, /* batch 1 */ -1., 2., 0.25, -3.];
        let eye: Vec<f32> = vec![1., 0., 0., 1.];
        let bias: Vec<f32> = vec![0.5, 1.0, /* batch 1 */ 2.0, -1.0];
        let g = Gemm::new(false, false, 2, 2, 2, a.as_ptr() as u64, eye.as_ptr() as u64, 0)
            .batched(2, 4, 0, 4)
            .bias_relu(bias.as_ptr() as u64, 2, true);
        let mut c = vec![f32::NAN; 8];
        unsafe { gemm_ref(&Gemm { c: c.as_mut_ptr() as u64, ..g }) };
        assert_eq!(c, vec![1.5, 0., 3.5, 1.5, 1., 1., 2.25, 0.]);
        // Without ReLU the negative sums stay; BF16 out rounds 1 + 2^-8 (a tie: BF16 keeps 7
        // fraction bits) to even, 1.
        let a1: Vec<f32> = vec![0.5 + 1.0 / 256.0, -2.0];
        let no_relu = Gemm::new(false, false, 1, 2, 2, a1.as_ptr() as u64, eye.as_ptr() as u64, 0).bias_relu(
            bias.as_ptr() as u64,
            0,
            false,
        );
        let mut c16 = vec![u16::MAX; 2];
        assert!(no_relu.bf16_out(c16.as_mut_ptr() as u64).has_epilogue());
        unsafe { gemm_ref(&no_relu.bf16_out(c16.as_mut_ptr() as u64)) };
        let got: Vec<f32> = c16.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        assert_eq!(got, vec![1.0, -1.0]);
        assert!(!Gemm::new(false, false, 1, 1, 1, 0, 0, 0).has_epilogue());
        assert!(!Gemm::new(false, false, 1, 1, 1, 0, 0, 0).bf16_out(0).has_epilogue());
    }
}
