// The INT8 variable selection of a TFT forecast: every variable's GRN and the selection mix
// in one launch (crates/fx-kernels/src/tft_int8.rs is the reference and documents the
// layout and every rounding step).
//
// Why one kernel: op by op, the encoder's 55 per-variable GRNs write and re-read
// [55, B * L_enc, d] F32 activations (~460 MB each at batch 256) between cuBLAS GEMMs and
// element-wise kernels; that traffic was most of an F32 forecast (profile in
// docs/perf/2026-12-02-h200-tft-forecast). Here a block takes 32 rows through all n
// variables with the activations in registers and shared memory: INT8 between the layers,
// the weights staged in shared memory per variable, products by dp4a with exact int32 sums.
// The first layer needs no GEMM: the variable's input is the scalar embedding
// raw · w_emb + b_emb, so fc1 folds to raw · u1 + c1 (u1, c1 computed on the host).
#include "fx_env.cuh"

#define FX_VI8_ROWS 32
#define FX_VI8_MAXD 128
// Shared rows of int8 words, padded by one word so that 32 lanes reading 32 different
// rows at one column hit 32 different banks.
#define FX_VI8_WP (FX_VI8_MAXD / 4 + 1)

__device__ __forceinline__ float fx_vi8_sigmoid(float x) { return 1.0f / (expf(-x) + 1.0f); }

__device__ __forceinline__ float fx_vi8_elu(float x) { return signbit(x) ? expf(x) - 1.0f : x; }

__device__ __forceinline__ float fx_vi8_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fx_vi8_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// clamp(round_half_even(x * inv), ±127): fx-quant's one rounding rule for activations.
__device__ __forceinline__ int fx_vi8_q(float x, float inv) {
    const float v = fminf(fmaxf(rintf(__fmul_rn(x, inv)), -127.0f), 127.0f);
    return (int)v;
}

// Quantises a warp's 4 rows (lane holds columns lane + 32 i) into the shared int8 tile;
// returns each row's step in s[]. `fixed` > 0 is a calibrated step; else each row's own
// max |x| / 127 (1 for an all-zero row).
__device__ __forceinline__ void fx_vi8_quantise(const float (&a)[4][4], float fixed, float (&s)[4],
                                                signed char* qb, int warp, int lane, fx_u32 d) {
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        float step = fixed;
        if (!(fixed > 0.0f)) {
            float m = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) m = fmaxf(m, fabsf(a[ri][i]));
            m = fx_vi8_warp_max(m);
            step = m > 0.0f ? m / 127.0f : 1.0f;
        }
        s[ri] = step;
        const float inv = 1.0f / step;
        signed char* row = qb + (warp * 4 + ri) * FX_VI8_WP * 4;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const fx_u32 c = lane + 32 * i;
            if (c < d) row[c] = (signed char)fx_vi8_q(a[ri][i], inv);
        }
    }
}

// Copies a [d, d] int8 matrix (d / 4 words a row) into a padded shared tile.
__device__ __forceinline__ void fx_vi8_load(int* dst, const int* __restrict__ src, fx_u32 d) {
    const fx_u32 words = d >> 2, total = d * words;
    for (fx_u32 t = threadIdx.x; t < total; t += blockDim.x) {
        const fx_u32 o = t / words;
        dst[o * FX_VI8_WP + (t - o * words)] = __ldg(src + t);
    }
}

// grid: ceil(rows / 32) blocks of 256 threads; warp w takes rows 4w .. 4w + 3 of the
// block's 32, lane l columns l, l + 32, l + 64, l + 96 (d a multiple of 4, at most 128).
// Row r of variable j: a1 = ELU(raw[r, j] u1[j] + c1[j]); a2 = q(a1) W2[j]ᵀ dequantised
// + b2[j]; g4, g5 = q(a2) W4[j]ᵀ, q(a2) W5[j]ᵀ dequantised + b4[j], b5[j];
// z = raw[r, j] w_emb[j] + b_emb[j] + σ(g4) ⊙ g5; out[r] = Σ_j wsel[r, j] LN_j(z).
// in2 / in45 ([n] calibrated input steps of fc2 and of fc4 = fc5) may be null: dynamic.
extern "C" __global__ void __launch_bounds__(256)
fx_tft_vsn_vars_i8(fx_u32 rows, fx_u32 n, fx_u32 d, const float* __restrict__ raw,
                   const float* __restrict__ emb_w, const float* __restrict__ emb_b,
                   const float* __restrict__ u1, const float* __restrict__ c1,
                   const int* __restrict__ w2, const int* __restrict__ w4, const int* __restrict__ w5,
                   const float* __restrict__ ws2, const float* __restrict__ ws4,
                   const float* __restrict__ ws5, const float* __restrict__ b2,
                   const float* __restrict__ b4, const float* __restrict__ b5,
                   const float* __restrict__ in2, const float* __restrict__ in45,
                   const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps,
                   const float* __restrict__ wsel, float* __restrict__ out) {
    __shared__ int qa[FX_VI8_ROWS * FX_VI8_WP];
    __shared__ int wa[FX_VI8_MAXD * FX_VI8_WP];
    __shared__ int wb[FX_VI8_MAXD * FX_VI8_WP];
    signed char* qb = (signed char*)qa;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const fx_u32 words = d >> 2;
    const fx_u64 mat = (fx_u64)d * words;  // words per matrix
    fx_u64 row[4];
    bool live[4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        row[ri] = (fx_u64)blockIdx.x * FX_VI8_ROWS + warp * 4 + ri;
        live[ri] = row[ri] < rows;
    }
    float acc_out[4][4];
#pragma unroll
    for (int ri = 0; ri < 4; ++ri)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc_out[ri][i] = 0.0f;

    for (fx_u32 j = 0; j < n; ++j) {
        const fx_u64 jd = (fx_u64)j * d;
        float x[4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) x[ri] = live[ri] ? raw[row[ri] * n + j] : 0.0f;

        // fc1 (folded) + ELU, quantised for fc2.
        float a[4][4], s1[4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const fx_u32 c = lane + 32 * i;
                a[ri][i] = c < d ? fx_vi8_elu(__fadd_rn(__fmul_rn(x[ri], u1[jd + c]), c1[jd + c])) : 0.0f;
            }
        fx_vi8_quantise(a, in2 ? in2[j] : 0.0f, s1, qb, warp, lane, d);
        fx_vi8_load(wa, w2 + j * mat, d);
        __syncthreads();

        // fc2: exact int32 sums, dequantised, + b2.
        {
            int acc[4][4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[ri][i] = 0;
            for (fx_u32 w = 0; w < words; ++w) {
                int av[4], bv[4];
#pragma unroll
                for (int ri = 0; ri < 4; ++ri) av[ri] = qa[(warp * 4 + ri) * FX_VI8_WP + w];
#pragma unroll
                for (int i = 0; i < 4; ++i) bv[i] = wa[(lane + 32 * i) * FX_VI8_WP + w];
#pragma unroll
                for (int ri = 0; ri < 4; ++ri)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[ri][i] = __dp4a(av[ri], bv[i], acc[ri][i]);
            }
#pragma unroll
            for (int ri = 0; ri < 4; ++ri)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const fx_u32 c = lane + 32 * i;
                    a[ri][i] = c < d ? __fadd_rn(__fmul_rn((float)acc[ri][i], __fmul_rn(ws2[jd + c], s1[ri])),
                                                 b2[jd + c])
                                     : 0.0f;
                }
        }
        __syncthreads();  // qa and wa are read; both are rewritten below.

        // fc4 and fc5 share the quantised a2.
        float s2[4];
        fx_vi8_quantise(a, in45 ? in45[j] : 0.0f, s2, qb, warp, lane, d);
        fx_vi8_load(wa, w4 + j * mat, d);
        fx_vi8_load(wb, w5 + j * mat, d);
        __syncthreads();
        int acc4[4][4], acc5[4][4];
#pragma unroll
        for (int ri = 0; ri < 4; ++ri)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc4[ri][i] = acc5[ri][i] = 0;
        for (fx_u32 w = 0; w < words; ++w) {
            int av[4], b4v[4], b5v[4];
#pragma unroll
            for (int ri = 0; ri < 4; ++ri) av[ri] = qa[(warp * 4 + ri) * FX_VI8_WP + w];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                b4v[i] = wa[(lane + 32 * i) * FX_VI8_WP + w];
                b5v[i] = wb[(lane + 32 * i) * FX_VI8_WP + w];
            }
#pragma unroll
            for (int ri = 0; ri < 4; ++ri)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc4[ri][i] = __dp4a(av[ri], b4v[i], acc4[ri][i]);
                    acc5[ri][i] = __dp4a(av[ri], b5v[i], acc5[ri][i]);
                }
        }
        __syncthreads();  // the next variable rewrites qa, wa, wb.

        // GLU over the embedding's residual, the variable's LayerNorm, the weighted mix.
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) {
            float z[4], sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const fx_u32 c = lane + 32 * i;
                z[i] = 0.0f;
                if (c < d) {
                    const float g4 = __fadd_rn(__fmul_rn((float)acc4[ri][i], __fmul_rn(ws4[jd + c], s2[ri])), b4[jd + c]);
                    const float g5 = __fadd_rn(__fmul_rn((float)acc5[ri][i], __fmul_rn(ws5[jd + c], s2[ri])), b5[jd + c]);
                    const float e = __fadd_rn(__fmul_rn(x[ri], emb_w[jd + c]), emb_b[jd + c]);
                    z[i] = __fadd_rn(e, __fmul_rn(fx_vi8_sigmoid(g4), g5));
                    sum += z[i];
                }
            }
            const float mean = fx_vi8_warp_sum(sum) / (float)d;
            float v = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (lane + 32 * i < d) v += (z[i] - mean) * (z[i] - mean);
            const float rstd = 1.0f / sqrtf(fx_vi8_warp_sum(v) / (float)d + eps);
            const float wj = live[ri] ? wsel[row[ri] * n + j] : 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const fx_u32 c = lane + 32 * i;
                if (c < d) acc_out[ri][i] += wj * ((z[i] - mean) * rstd * ln_w[jd + c] + ln_b[jd + c]);
            }
        }
    }
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
        if (!live[ri]) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const fx_u32 c = lane + 32 * i;
            if (c < d) out[row[ri] * d + c] = acc_out[ri][i];
        }
    }
}
