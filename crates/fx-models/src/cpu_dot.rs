//! The F32 dot product of the CPU decision paths (`mlp_cpu`'s heads, `mamba2_cpu`'s GEMVs):
//! 32 independent lanes the compiler vectorises, compiled twice — AVX2 + FMA, chosen at run
//! time where the CPU has them, and portable — with a fixed summation order, so results are
//! reproducible on one machine.

/// Whether this CPU runs the AVX2 + FMA builds of the layer and dot kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_fma() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// `Σ a_i b_i` over 32 independent F32 lanes, then 8, then one (a fixed order, so results
/// are reproducible on one machine). Plain multiply-add: without the FMA target feature,
/// `mul_add` is a libm call per element (seen here: 20× slower).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 32];
    let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
    let (ra, rb) = (a32.remainder(), b32.remainder());
    for (x, y) in a32.zip(b32) {
        for k in 0..32 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut acc8 = [0.0f32; 8];
    let (a8, b8) = (ra.chunks_exact(8), rb.chunks_exact(8));
    let (ra, rb) = (a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        for k in 0..8 {
            acc8[k] += x[k] * y[k];
        }
    }
    for k in 0..32 {
        acc8[k % 8] += acc[k];
    }
    let mut s = ((acc8[0] + acc8[4]) + (acc8[1] + acc8[5])) + ((acc8[2] + acc8[6]) + (acc8[3] + acc8[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// [`dot_lanes`] compiled for AVX2 + FMA (chosen at run time when the CPU has them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

pub(crate) fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_lanes(a, b)
}

/// The fastest dot product this CPU runs (decided once per policy or model).
pub(crate) fn pick_dot() -> fn(&[f32], &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the features `dot_avx2` is compiled for were detected on this CPU.
        return |a, b| unsafe { dot_avx2(a, b) };
    }
    dot_portable
}
