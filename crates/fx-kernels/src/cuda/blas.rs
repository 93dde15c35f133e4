//! cuBLAS through cudarc on candle's stream, on raw device addresses ([`Blas`]): row-major
//! GEMMs (single or strided-batched, F32 or BF16 inputs with F32 accumulation) and column
//! sums, writing F32 or BF16. A GEMM with an epilogue (bias, ReLU) runs through cuBLASLt
//! ([`super::blas_lt`]), which folds it into the GEMM's own write instead of a pass over
//! the output. The fused training steps (DQN, PPO, TFT, MAMBA-2) build on it; nothing here
//! reads to the host, so a CUDA graph can capture every call.

use std::sync::Arc;

use candle_core::Device;
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};

use super::blas_lt::LtHandle;
use super::cuda_device;
use crate::error::{Error, Result};
pub use crate::gemm::{Gemm, GemmInputs, GemmOutput};

fn blas_err(context: &'static str) -> impl Fn(cudarc::cublas::result::CublasError) -> Error {
    move |e| Error::Cuda { context, message: format!("{e:?}") }
}

/// The device's cuBLAS handle (candle's, on candle's stream), with row-major helpers on raw
/// addresses.
///
/// Shared, not made per caller: `cublasDestroy` synchronises the whole device, and a fused
/// step dropped on one thread while another thread captures a CUDA graph on the same GPU
/// invalidated that capture. The handle lives as long as the device (fx pools devices and
/// never tears them down); a device is used by one thread at a time, like the handle.
pub struct Blas {
    blas: Arc<CudaBlas>,
    device: candle_core::cuda::CudaDevice,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Blas")
    }
}

impl Blas {
    /// `device`'s handle (candle's stream); makes nothing, so it cannot fail on the driver.
    pub fn new(device: &Device) -> Result<Self> {
        let dev = cuda_device(device, "device", "Blas::new")?;
        Ok(Self { blas: dev.cublas_handle(), device: dev.clone() })
    }

    /// Whether cuBLASLt has an algorithm for `g` (always true without an epilogue, which
    /// cuBLAS runs). Asks once per shape and caches the answer; a caller picks
    /// its unfused path when this says no.
    pub fn supports(&self, g: &Gemm) -> Result<bool> {
        if !g.has_epilogue() {
            return Ok(true);
        }
        LtHandle::of(&self.device)?.supports(g)
    }

    /// Row-major `C[m, n] = alpha · op(A) · op(B) + beta · C`, `op(A)` `[m, k]`, `op(B)` `[k, n]`;
    /// `lda`/`ldb`/`ldc` are the row strides of the stored matrices (A stored `[k, m]` when
    /// `ta`, B stored `[n, k]` when `tb`).
    ///
    /// # Safety
    /// The addresses must hold the matrices described, on this device, until the GEMM ran.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        beta: f32,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        // Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage first.
        blas::sgemm(
            *self.blas.handle(),
            if tb { T } else { N },
            if ta { T } else { N },
            n as i32,
            m as i32,
            k as i32,
            &alpha,
            b as *const f32,
            ldb as i32,
            a as *const f32,
            lda as i32,
            &beta,
            c as *mut f32,
            ldc as i32,
        )
        .map_err(blas_err("Blas::gemm"))
    }

    /// [`Blas::gemm`] with BF16 `A` and `B`, F32 `C` and F32 accumulation (BF16 compute
    /// with F32 outputs: the tensor cores' fast path).
    ///
    /// # Safety
    /// As [`Blas::gemm`], with `a` and `b` holding BF16 values.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_bf16(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        use blas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        let (alpha, beta) = (1.0f32, 0.0f32);
        blas::gemm_ex(
            *self.blas.handle(),
            if tb { T } else { N },
            if ta { T } else { N },
            n as i32,
            m as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            b as *const std::ffi::c_void,
            CUDA_R_16BF,
            ldb as i32,
            a as *const std::ffi::c_void,
            CUDA_R_16BF,
            lda as i32,
            (&beta as *const f32).cast(),
            c as *mut std::ffi::c_void,
            CUDA_R_32F,
            ldc as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(blas_err("Blas::gemm_bf16"))
    }

    /// Column sums `y[c] = alpha · Σ_r A[r, c]` of a row-major `A[rows, cols]` with row stride
    /// `lda`, using `ones` (at least `rows` ones) — the bias gradients of a layer.
    ///
    /// # Safety
    /// As [`Blas::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn col_sums(
        &self,
        rows: usize,
        cols: usize,
        alpha: f32,
        a: u64,
        lda: usize,
        ones: u64,
        y: u64,
    ) -> Result<()> {
        let beta = 0.0f32;
        // Row-major A is column-major Aᵀ [cols, rows]: y = Aᵀ · ones.
        blas::sgemv(
            *self.blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            cols as i32,
            rows as i32,
            &alpha,
            a as *const f32,
            lda as i32,
            ones as *const f32,
            1,
            &beta,
            y as *mut f32,
            1,
        )
        .map_err(blas_err("Blas::col_sums"))
    }

    /// Runs `g`: one row-major GEMM or a strided batch of them (see [`Gemm`]).
    ///
    /// # Safety
    /// Every matrix `g` describes (each batch entry at its stride) must lie in live device
    /// memory of this device holding the element types `g.inputs` and `g.output` name (and
    /// the F32 bias when set) until the GEMM ran. A GEMM with an epilogue cuBLASLt has no
    /// algorithm for is an error ([`Blas::supports`] asks first).
    pub unsafe fn run(&self, g: &Gemm) -> Result<()> {
        if g.has_epilogue() {
            return LtHandle::of(&self.device)?.run(g, &self.device);
        }
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
        use blas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        const CTX: &str = "Blas::run";
        let i32_of = |v: usize, what: &str| -> Result<i32> {
            i32::try_from(v).map_err(|_| Error::Cuda { context: CTX, message: format!("{what} {v} exceeds i32") })
        };
        let (m, n, k) = (i32_of(g.m, "m")?, i32_of(g.n, "n")?, i32_of(g.k, "k")?);
        let (lda, ldb, ldc) = (i32_of(g.lda, "lda")?, i32_of(g.ldb, "ldb")?, i32_of(g.ldc, "ldc")?);
        let batch = i32_of(g.batch.max(1), "batch")?;
        let (op_a, op_b) = (if g.ta { T } else { N }, if g.tb { T } else { N });
        let in_type = match g.inputs {
            GemmInputs::F32 => CUDA_R_32F,
            GemmInputs::Bf16 => CUDA_R_16BF,
        };
        // F32 accumulation either way; a BF16 C is the F32 result rounded once. cuBLAS writes
        // a BF16 C from BF16 inputs only.
        let out_type = match (g.inputs, g.output) {
            (_, GemmOutput::F32) => CUDA_R_32F,
            (GemmInputs::Bf16, GemmOutput::Bf16) => CUDA_R_16BF,
            (GemmInputs::F32, GemmOutput::Bf16) => {
                return Err(Error::Cuda { context: CTX, message: "a BF16 C from F32 inputs (cuBLAS has none)".into() })
            }
        };
        // Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ: B's storage first.
        let r = if g.batch <= 1 {
            blas::gemm_ex(
                *self.blas.handle(),
                op_b,
                op_a,
                n,
                m,
                k,
                (&g.alpha as *const f32).cast(),
                g.b as *const std::ffi::c_void,
                in_type,
                ldb,
                g.a as *const std::ffi::c_void,
                in_type,
                lda,
                (&g.beta as *const f32).cast(),
                g.c as *mut std::ffi::c_void,
                out_type,
                ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        } else {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_b,
                op_a,
                n,
                m,
                k,
                (&g.alpha as *const f32).cast(),
                g.b as *const std::ffi::c_void,
                in_type,
                ldb,
                g.stride_b,
                g.a as *const std::ffi::c_void,
                in_type,
                lda,
                g.stride_a,
                (&g.beta as *const f32).cast(),
                g.c as *mut std::ffi::c_void,
                out_type,
                ldc,
                g.stride_c,
                batch,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        r.map_err(blas_err(CTX))
    }
}
