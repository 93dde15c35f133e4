//! cuBLASLt for the [`Gemm`]s with an epilogue or a BF16 output ([`LtHandle`]): the bias and
//! ReLU are applied to the F32 accumulators and the result rounded once to `C`'s type as the
//! GEMM writes it, so no pass over the output follows. Reached through
//! [`super::blas::Blas::run`]; its CPU reference is [`crate::gemm::gemm_ref`].

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda::{CudaDevice, DeviceId};
use cudarc::cublaslt::{result as lt, sys};

use crate::error::{Error, Result};
use crate::gemm::{Gemm, GemmInputs, GemmOutput};

const CTX: &str = "Blas::run (cuBLASLt)";

/// Hopper's recommended cuBLASLt workspace.
const WORKSPACE: usize = 32 << 20;

fn lt_err(e: lt::CublasError) -> Error {
    Error::Cuda { context: CTX, message: format!("{e:?}") }
}

/// A GEMM's shape, types and alignment: what the algorithm choice depends on (not the
/// addresses, beyond their alignment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    ta: bool,
    tb: bool,
    mnk: [usize; 3],
    ld: [usize; 3],
    batch: usize,
    strides: [i64; 4],
    inputs: GemmInputs,
    output: GemmOutput,
    bias: bool,
    relu: bool,
    align: [u32; 4],
}

/// The largest power of two up to 256 dividing every byte offset in `v` (cuBLASLt assumes
/// 256-byte aligned matrices unless told otherwise).
fn alignment(v: &[u64]) -> u32 {
    v.iter().fold(256u32, |a, &x| if x == 0 { a } else { a.min(1 << x.trailing_zeros().min(8)) })
}

impl Shape {
    fn of(g: &Gemm) -> Self {
        let ei = match g.inputs {
            GemmInputs::F32 => 4,
            GemmInputs::Bf16 => 2,
        };
        let eo = match g.output {
            GemmOutput::F32 => 4,
            GemmOutput::Bf16 => 2,
        };
        let st = |s: i64, e: u64| (s.unsigned_abs()) * e;
        Self {
            ta: g.ta,
            tb: g.tb,
            mnk: [g.m, g.n, g.k],
            ld: [g.lda, g.ldb, g.ldc],
            batch: g.batch.max(1),
            strides: [g.stride_a, g.stride_b, g.stride_c, g.stride_bias],
            inputs: g.inputs,
            output: g.output,
            bias: g.bias != 0,
            relu: g.relu,
            align: [
                alignment(&[g.a, st(g.stride_a, ei), g.lda as u64 * ei]),
                alignment(&[g.b, st(g.stride_b, ei), g.ldb as u64 * ei]),
                alignment(&[g.c, st(g.stride_c, eo), g.ldc as u64 * eo]),
                alignment(&[g.bias, st(g.stride_bias, 4)]),
            ],
        }
    }
}

/// The descriptors of one GEMM (destroyed on drop; the launch has captured what it needs).
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    /// Column-major A (the row-major B), B (the row-major A), C = D.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each handle was created by `Descriptors::new` and is destroyed once; a
        // failure to destroy a host-side descriptor leaks it, nothing more.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.pref);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

unsafe fn set_desc<T>(d: sys::cublasLtMatmulDesc_t, a: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    lt::set_matmul_desc_attribute(d, a, (v as *const T).cast(), std::mem::size_of::<T>()).map_err(lt_err)
}

unsafe fn set_layout<T>(l: sys::cublasLtMatrixLayout_t, a: sys::cublasLtMatrixLayoutAttribute_t, v: &T) -> Result<()> {
    lt::set_matrix_layout_attribute(l, a, (v as *const T).cast(), std::mem::size_of::<T>()).map_err(lt_err)
}

unsafe fn set_pref<T>(
    p: sys::cublasLtMatmulPreference_t,
    a: sys::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<()> {
    lt::set_matmul_pref_attribute(p, a, (v as *const T).cast(), std::mem::size_of::<T>()).map_err(lt_err)
}

impl Descriptors {
    /// Row-major `C = op(A) op(B)` is column-major `Cᵀ = op(B)ᵀ op(A)ᵀ`: the row-major B is
    /// cuBLASLt's A. The bias runs along the column-major rows of `Cᵀ`, i.e. `C`'s columns.
    unsafe fn new(g: &Gemm, s: &Shape) -> Result<Self> {
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatrixLayoutAttribute_t as L;
        use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
        let in_t = match g.inputs {
            GemmInputs::F32 => CUDA_R_32F,
            GemmInputs::Bf16 => CUDA_R_16BF,
        };
        let out_t = match g.output {
            GemmOutput::F32 => CUDA_R_32F,
            GemmOutput::Bf16 => CUDA_R_16BF,
        };
        // F32 inputs stay F32 on the cores (no TF32), as on the cuBLAS path.
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F).map_err(lt_err)?;
        let mut me = Self { desc, layouts: [std::ptr::null_mut(); 3], pref: std::ptr::null_mut() };
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (an int32 attribute).
        let op = |t: bool| t as i32;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.tb))?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.ta))?;
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match (g.bias != 0, g.relu) {
            (true, true) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, false) => E::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => E::CUBLASLT_EPILOGUE_RELU,
            (false, false) => E::CUBLASLT_EPILOGUE_DEFAULT,
        };
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        if g.bias != 0 {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &(g.bias as *const c_void))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &CUDA_R_32F)?;
            if s.batch > 1 {
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &g.stride_bias)?;
            }
        }
        // Stored row-major [r, c] with row stride ld is column-major [c, r] with ld.
        let (b_rows, b_cols) = if g.tb { (g.n, g.k) } else { (g.k, g.n) };
        let (a_rows, a_cols) = if g.ta { (g.k, g.m) } else { (g.m, g.k) };
        let specs = [
            (in_t, b_cols, b_rows, g.ldb, g.stride_b),
            (in_t, a_cols, a_rows, g.lda, g.stride_a),
            (out_t, g.n, g.m, g.ldc, g.stride_c),
        ];
        for (i, (t, rows, cols, ld, stride)) in specs.into_iter().enumerate() {
            me.layouts[i] = lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map_err(lt_err)?;
            if s.batch > 1 {
                set_layout(me.layouts[i], L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &(s.batch as i32))?;
                set_layout(me.layouts[i], L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride)?;
            }
        }
        me.pref = lt::create_matmul_pref().map_err(lt_err)?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        set_pref(me.pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WORKSPACE)?;
        let [aa, ab, ac, _] = s.align;
        set_pref(me.pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ab)?;
        set_pref(me.pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &aa)?;
        set_pref(me.pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac)?;
        set_pref(me.pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac)?;
        Ok(me)
    }
}

/// A device's cuBLASLt handle, workspace and the algorithms chosen per GEMM shape. One per
/// device, never destroyed (as the cuBLAS handle: fx keeps its devices for the process).
pub(crate) struct LtHandle {
    handle: sys::cublasLtHandle_t,
    /// A raw allocation, never freed: a `CudaSlice` would hold the device's stream for the
    /// process, and fx's device pool lends a device again only when nothing else holds it.
    workspace: u64,
    algos: Mutex<HashMap<Shape, Option<sys::cublasLtMatmulAlgo_t>>>,
}

// SAFETY: the handle is used by one thread at a time (the device's, as the cuBLAS handle)
// and the cache is behind a mutex.
unsafe impl Send for LtHandle {}
unsafe impl Sync for LtHandle {}

impl LtHandle {
    /// `dev`'s handle, made at its first use.
    pub(crate) fn of(dev: &CudaDevice) -> Result<Arc<Self>> {
        static HANDLES: OnceLock<Mutex<HashMap<DeviceId, Arc<LtHandle>>>> = OnceLock::new();
        let mut map = HANDLES.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = map.get(&dev.id()) {
            return Ok(h.clone());
        }
        let driver =
            |e: cudarc::driver::DriverError| Error::Cuda { context: CTX, message: format!("workspace: {e:?}") };
        dev.cuda_stream().context().bind_to_thread().map_err(driver)?;
        let handle = lt::create_handle().map_err(lt_err)?;
        // SAFETY: a plain allocation in the bound context, only ever handed to cuBLASLt as
        // scratch on the device's stream (its launches are ordered on it).
        let workspace = unsafe { cudarc::driver::result::malloc_sync(WORKSPACE) }.map_err(driver)?;
        let h = Arc::new(Self { handle, workspace, algos: Mutex::new(HashMap::new()) });
        map.insert(dev.id(), h.clone());
        Ok(h)
    }

    /// The algorithm for `g`'s shape (None: cuBLASLt has none), asked once per shape.
    unsafe fn algo(&self, d: &Descriptors, s: &Shape) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
        let mut algos = self.algos.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = algos.get(s) {
            return Ok(*a);
        }
        let [la, lb, lc] = d.layouts;
        // No preference names the bias's alignment, and the bias epilogue is reported to need
        // 16 bytes: a less aligned bias takes the unfused path.
        if s.bias && s.align[3] < 16 {
            algos.insert(*s, None);
            return Ok(None);
        }
        let found = match lt::get_matmul_algo_heuristic(self.handle, d.desc, la, lb, lc, lc, d.pref) {
            Ok(h) if h.workspaceSize <= WORKSPACE => Some(h.algo),
            // Any refusal (not supported, or a combination this cuBLASLt rejects as invalid)
            // means no algorithm: the caller takes its unfused path.
            Ok(_) | Err(_) => None,
        };
        algos.insert(*s, found);
        Ok(found)
    }

    /// Whether cuBLASLt has an algorithm for `g` (descriptors it refuses to build count as
    /// none).
    pub(crate) fn supports(&self, g: &Gemm) -> Result<bool> {
        let s = Shape::of(g);
        // SAFETY: building descriptors and asking the heuristic touch no device memory.
        unsafe {
            let Ok(d) = Descriptors::new(g, &s) else { return Ok(false) };
            Ok(self.algo(&d, &s)?.is_some())
        }
    }

    /// Enqueues `g` on `dev`'s stream.
    ///
    /// # Safety
    /// As [`super::blas::Blas::run`].
    pub(crate) unsafe fn run(&self, g: &Gemm, dev: &CudaDevice) -> Result<()> {
        let s = Shape::of(g);
        let d = Descriptors::new(g, &s)?;
        let Some(algo) = self.algo(&d, &s)? else {
            return Err(Error::Cuda { context: CTX, message: format!("no cuBLASLt algorithm for {g:?}") });
        };
        let [la, lb, lc] = d.layouts;
        let stream = dev.cuda_stream();
        stream.context().bind_to_thread().map_err(|e| Error::Cuda { context: CTX, message: format!("bind: {e:?}") })?;
        lt::matmul(
            self.handle,
            d.desc,
            (&g.alpha as *const f32).cast(),
            (&g.beta as *const f32).cast(),
            g.b as *const c_void,
            la,
            g.a as *const c_void,
            lb,
            g.c as *const c_void,
            lc,
            g.c as *mut c_void,
            lc,
            &algo,
            self.workspace as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(lt_err)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::super::address;
    use super::super::blas::Blas;
    use crate::gemm::{gemm_ref, Gemm};
    use crate::rng;
    use fx_hw::test_gpu as gpu;

    fn random(len: usize, seed: u64, salt: u64) -> Vec<f32> {
        (0..len as u64).map(|i| (rng::draw(seed, salt, 0, i) * 2.0 - 1.0) as f32).collect()
    }

    /// What this cuBLASLt's heuristic offers for a population trunk layer's GEMM (4 entries
    /// of [512, 256] x [256, 256]ᵀ, BF16 in) and its unbatched form: F32 or BF16 out, no
    /// epilogue, bias + ReLU with an F32 bias, with a bias of D's type (BF16), and F32 in and
    /// out. Printed as a table (the choice of epilogue follows it); a plain BF16 GEMM must
    /// have an algorithm.
    #[test]
    fn heuristic_support_of_the_trunk_gemms() {
        use super::{lt, set_desc, sys, Descriptors, LtHandle, Shape};
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cudaDataType_t::CUDA_R_16BF;
        let Some(dev) = gpu("blas_lt::heuristic_support_of_the_trunk_gemms") else { return };
        let h = LtHandle::of(super::super::cuda_device(&dev, "device", "test").unwrap()).unwrap();
        let (nb, m, n, k) = (4usize, 512usize, 256usize, 256usize);
        let buf = |len: usize, dt: DType| Tensor::zeros(len, dt, &dev).unwrap();
        let (a16, b16, c16) =
            (buf(nb * m * k, DType::BF16), buf(nb * n * k, DType::BF16), buf(nb * m * n, DType::BF16));
        let (a32, b32, c32) = (buf(nb * m * k, DType::F32), buf(nb * n * k, DType::F32), buf(nb * m * n, DType::F32));
        let bias = buf(nb * n, DType::F32);
        let bias16 = buf(nb * n, DType::BF16);
        let p16 = |t: &Tensor| address::<half::bf16>(t, "t").unwrap();
        let p32 = |t: &Tensor| address::<f32>(t, "t").unwrap();
        let mut plain_ok = false;
        for batch in [nb, 1] {
            for (name, bf_in, bf_out, epi, bias_t) in [
                ("bf16 in, f32 out, no epilogue", true, false, false, 0u8),
                ("bf16 in, f32 out, bias+relu f32 bias", true, false, true, 0),
                ("bf16 in, bf16 out, no epilogue", true, true, false, 0),
                ("bf16 in, bf16 out, bias+relu f32 bias", true, true, true, 0),
                ("bf16 in, bf16 out, bias+relu bf16 bias", true, true, true, 1),
                ("bf16 in, bf16 out, bias+relu default-type bias", true, true, true, 2),
                ("f32 in, f32 out, bias+relu f32 bias", false, false, true, 0),
            ] {
                let (a, b) = if bf_in { (p16(&a16), p16(&b16)) } else { (p32(&a32), p32(&b32)) };
                let c = if bf_out { p16(&c16) } else { p32(&c32) };
                let mut g = Gemm::new(false, true, m, n, k, a, b, c);
                if batch > 1 {
                    g = g.batched(batch, m * k, n * k, m * n);
                }
                if bf_in {
                    g = g.bf16(a, b);
                }
                if bf_out {
                    g = g.bf16_out(c);
                }
                if epi {
                    g = g.bias_relu(if bias_t == 1 { p16(&bias16) } else { p32(&bias) }, n, true);
                }
                let s = Shape::of(&g);
                // SAFETY: descriptors and a heuristic query touch no device memory.
                let got = unsafe {
                    let d = Descriptors::new(&g, &s).unwrap();
                    if epi && bias_t == 1 {
                        set_desc(d.desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &CUDA_R_16BF).unwrap();
                    }
                    if epi && bias_t == 2 {
                        set_desc(d.desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &-1i32).unwrap();
                    }
                    let [la, lb, lc] = d.layouts;
                    lt::get_matmul_algo_heuristic(h.handle, d.desc, la, lb, lc, lc, d.pref)
                };
                let text = match &got {
                    Ok(r) => format!("algorithm (workspace {} B)", r.workspaceSize),
                    Err(e) => format!("none: {e:?}"),
                };
                eprintln!("lt support, batch {batch}: {name}: {text}");
                plain_ok |= name.ends_with("f32 out, no epilogue") && got.is_ok();
            }
        }
        assert!(plain_ok, "cuBLASLt offers no algorithm for a plain BF16 GEMM");
    }

    /// Every epilogue GEMM the fused steps use (bias + ReLU, bias alone; BF16 or F32 out; BF16
    /// or F32 in; strided batches whose every entry has its own bias; a batch starting mid-
    /// buffer at an unaligned row, as a target trunk reads s') equals the f64 reference on
    /// fresh random inputs, every element, within C's rounding; so do the BF16-output GEMMs
    /// without an epilogue (cuBLAS's, the split trunk forward's).
    #[test]
    fn epilogue_gemms_match_the_reference() {
        let Some(dev) = gpu("blas_lt::epilogue_gemms_match_the_reference") else { return };
        let seed = fx_hw::test_seed("blas_lt::epilogue_gemms_match_the_reference");
        let blas = Blas::new(&dev).unwrap();
        // (batch, m, n, k, ta, tb, row offset of A, bf16 in, bf16 out, relu, bias)
        let cases = [
            (5usize, 37usize, 48usize, 24usize, false, true, 37usize, true, true, true, true),
            (4, 512, 256, 256, false, true, 0, true, true, true, true),
            (3, 64, 128, 256, false, true, 64, true, false, true, true),
            (2, 33, 20, 17, true, false, 0, true, false, false, true),
            (3, 40, 24, 16, false, true, 0, false, false, true, true),
            (4, 512, 256, 256, false, true, 0, true, true, false, false),
            (3, 37, 48, 24, false, true, 37, true, true, false, false),
        ];
        for (ci, &(nb, m, n, k, ta, tb, off, bf_in, bf_out, relu, with_bias)) in cases.iter().enumerate() {
            let salt = 100 * ci as u64;
            // A entries are `off + m·k` values apart, the product reading from `off·k` on.
            let a_entry = (off + m) * k;
            let a = random(nb * a_entry, seed, salt);
            let b = random(nb * n * k, seed, salt + 1);
            let bias = random(nb * n, seed, salt + 2);
            let round = |v: &[f32]| -> Vec<f32> {
                if bf_in {
                    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
                } else {
                    v.to_vec()
                }
            };
            let (a, b) = (round(&a), round(&b));
            // Host reference: inputs in the GEMM's type, C in F32 or BF16.
            let a16: Vec<half::bf16> = a.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let b16: Vec<half::bf16> = b.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let (ha, hb) =
                if bf_in { (a16.as_ptr() as u64, b16.as_ptr() as u64) } else { (a.as_ptr() as u64, b.as_ptr() as u64) };
            let es = if bf_in { 2 } else { 4 };
            let g = |a: u64, b: u64, c: u64, bias: u64| {
                let mut g = Gemm::new(ta, tb, m, n, k, a + (off * k * es) as u64, b, c)
                    .batched(nb, a_entry, n * k, m * n)
                    .bias_relu(if with_bias { bias } else { 0 }, n, relu);
                if bf_in {
                    g = g.bf16(g.a, g.b);
                }
                if bf_out {
                    g = g.bf16_out(c);
                }
                g
            };
            let mut want32 = vec![f32::NAN; nb * m * n];
            let mut want16 = vec![half::bf16::NAN; nb * m * n];
            let hc = if bf_out { want16.as_mut_ptr() as u64 } else { want32.as_mut_ptr() as u64 };
            // SAFETY: host buffers of the sizes the GEMM describes.
            unsafe { gemm_ref(&g(ha, hb, hc, bias.as_ptr() as u64)) };
            let want: Vec<f32> = if bf_out { want16.iter().map(|x| x.to_f32()).collect() } else { want32 };
            // Device: the same buffers, C filled with NaN so an unwritten element fails.
            let up = |v: &[f32], len: usize| {
                let t = Tensor::from_vec(v.to_vec(), len, &dev).unwrap();
                if bf_in {
                    t.to_dtype(DType::BF16).unwrap()
                } else {
                    t
                }
            };
            let (da, db) = (up(&a, a.len()), up(&b, b.len()));
            let dbias = Tensor::from_vec(bias.clone(), bias.len(), &dev).unwrap();
            let nan = Tensor::full(f32::NAN, nb * m * n, &dev).unwrap();
            let dc = if bf_out { nan.to_dtype(DType::BF16).unwrap() } else { nan };
            let addr = |t: &Tensor| -> u64 {
                if t.dtype() == DType::BF16 {
                    address::<half::bf16>(t, "t").unwrap()
                } else {
                    address::<f32>(t, "t").unwrap()
                }
            };
            let dg = g(addr(&da), addr(&db), addr(&dc), addr(&dbias));
            assert!(blas.supports(&dg).unwrap(), "case {ci}: cuBLASLt has no algorithm for {dg:?}");
            // SAFETY: device tensors of the sizes the GEMM describes, alive past the sync.
            unsafe { blas.run(&dg).unwrap() };
            dev.synchronize().unwrap();
            let got: Vec<f32> = dc.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            let mut worst = 0f32;
            for (i, (&x, &w)) in got.iter().zip(&want).enumerate() {
                assert!(x.is_finite() && w.is_finite(), "case {ci} [{i}]: gpu {x}, reference {w}");
                // F32 accumulation over k, then for a BF16 out one rounding of the F32 result,
                // which may land an ulp (2^-8 relative) from the f64 result's rounding.
                let acc = 1e-5 * (1.0 + w.abs()) * (k as f32).sqrt();
                let tol = if bf_out { w.abs() / 128.0 + acc } else { acc };
                assert!((x - w).abs() <= tol, "case {ci} [{i}]: gpu {x} vs reference {w}");
                worst = worst.max((x - w).abs());
            }
            if relu {
                assert!(got.contains(&0.0) && got.iter().any(|&x| x > 0.0), "case {ci}: ReLU not exercised");
            } else {
                assert!(got.iter().any(|&x| x < 0.0), "case {ci}: no negative output without ReLU");
            }
            eprintln!("blas_lt case {ci} {nb}x[{m},{n},{k}] bf16 in {bf_in} out {bf_out}: worst abs err {worst:.2e}");
        }
    }
}
