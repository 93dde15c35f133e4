// The INT8 variable selection of a TFT forecast: every variable's GRN and the selection mix
// in one launch (crates/fx-models/src/tft/int8.rs is the reference and documents the
// layout and every rounding step).
//
// Why one kernel: op by op, the encoder's 55 per-variable GRNs write and re-read
// [55, B * L_enc, d] F32 activations (~460 MB each at batch 256) between cuBLAS GEMMs and
// element-wise kernels; that traffic was most of an F32 forecast (profile in
// docs/perf/2026-12-02-h200-tft-forecast). Here a block takes 64 rows through its share of
// the n variables with the activations in registers and shared memory: INT8 between the
// layers, the weights staged in shared memory per variable, products on the tensor cores
// (mma.sync m16n8k32 s8, exact int32 sums). A first version with dp4a products ran at 18
// T MAC/s on the H200 (docs/perf/2026-12-02-h200-tft-int8/1-dp4a): too slow to matter.
// The first layer needs no GEMM: the variable's input is the scalar embedding
// raw · w_emb + b_emb, so fc1 folds to raw · u1 + c1 (u1, c1 computed on the host).
#include "fx_rng.cuh"
#include "fx_int8.cuh"

#define FX_VI8_ROWS 64
#define FX_VI8_MAXD 128
// Shared rows of int8 words: 128 bytes + 16 of padding, so that a fragment load (8 rows ×
// 4 consecutive words across a warp) hits 32 different banks.
#define FX_VI8_P 36

__device__ __forceinline__ float fx_vi8_sigmoid(float x) { return 1.0f / (expf(-x) + 1.0f); }

__device__ __forceinline__ float fx_vi8_elu(float x) { return signbit(x) ? expf(x) - 1.0f : x; }


// c += a · b for one m16n8k32 tile: A 16×32 row-major, B 32×8 column-major (a weight's rows).
__device__ __forceinline__ void fx_vi8_mma(int (&c)[4], const int (&a)[4], int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Copies a [d, d] int8 matrix (d / 4 words a row) into a shared tile, zero-filling the
// words from d / 4 up to kw (K padded to a multiple of 32). With d a multiple of 16 (rows
// 16-byte aligned) in 16-byte loads, four in flight per thread: one load at a time, the
// staging waited on L2 once per word (a profile put ~36 µs per variable per block there).
__device__ __forceinline__ void fx_vi8_load(int* dst, const int* __restrict__ src, fx_u32 d, fx_u32 kw) {
    if ((d & 15u) == 0) {
        const fx_u32 q = d >> 4, kq = kw >> 2, total = d * kq;
        for (fx_u32 t0 = threadIdx.x; t0 < total; t0 += 4 * blockDim.x) {
            int4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const fx_u32 t = t0 + u * blockDim.x, o = t / kq, w = t - o * kq;
                v[u] = make_int4(0, 0, 0, 0);
                if (t < total && w < q) v[u] = __ldg(reinterpret_cast<const int4*>(src) + o * q + w);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const fx_u32 t = t0 + u * blockDim.x, o = t / kq, w = t - o * kq;
                if (t < total) *reinterpret_cast<int4*>(dst + o * FX_VI8_P + 4 * w) = v[u];
            }
        }
        return;
    }
    const fx_u32 words = d >> 2, total = d * kw;
    for (fx_u32 t = threadIdx.x; t < total; t += blockDim.x) {
        const fx_u32 o = t / kw, w = t - o * kw;
        dst[o * FX_VI8_P + w] = w < words ? __ldg(src + o * words + w) : 0;
    }
}

// One warp's 16 × 64 block of q · Wᵀ: rows m0 .. m0 + 15 of the shared q, the weight rows
// (output columns) nb .. nb + 63, K = 32 · ksteps. acc[t] is n-tile t (columns nb + 8t ..):
// element i at row m0 + g + 8 (i >> 1), column nb + 8t + 2 tig + (i & 1).
__device__ __forceinline__ void fx_vi8_gemm(int (&acc)[8][4], const int* qa, const int* w, int m0, int nb, int lane,
                                            fx_u32 ksteps) {
    const int g = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0;
    for (fx_u32 ks = 0; ks < ksteps; ++ks) {
        const int kw = ks * 8 + tig;
        int a[4];
        a[0] = qa[(m0 + g) * FX_VI8_P + kw];
        a[1] = qa[(m0 + g + 8) * FX_VI8_P + kw];
        a[2] = qa[(m0 + g) * FX_VI8_P + kw + 4];
        a[3] = qa[(m0 + g + 8) * FX_VI8_P + kw + 4];
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int row = nb + t * 8 + g;
            fx_vi8_mma(acc[t], a, w[row * FX_VI8_P + kw], w[row * FX_VI8_P + kw + 4]);
        }
    }
}

// The quantisation step of this thread's two rows (block rows lr, lr + 8; 16 values each,
// the rest of each row in the other three lanes of the quad and the other column-half
// warp): `fixed` > 0, else the row's max |a| / 127 (1 for an all-zero row). Synchronises.
__device__ __forceinline__ void fx_vi8_steps(const float (&a)[2][8][2], float fixed, float (&s)[2],
                                             float (*red)[2], int lr, int nh, int tig) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float m = 0.0f;
#pragma unroll
        for (int t = 0; t < 8; ++t) m = fmaxf(m, fmaxf(fabsf(a[rr][t][0]), fabsf(a[rr][t][1])));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (tig == 0) red[lr + 8 * rr][nh] = m;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float m = fmaxf(red[lr + 8 * rr][0], red[lr + 8 * rr][1]);
        s[rr] = fixed > 0.0f ? fixed : (m > 0.0f ? m / 127.0f : 1.0f);
    }
}

// Writes this thread's values of a, quantised with the rows' steps, into the shared q.
__device__ __forceinline__ void fx_vi8_store(const float (&a)[2][8][2], const float (&s)[2], signed char* qb, int lr,
                                             int nb, int tig) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const float inv = 1.0f / s[rr];
        signed char* row = qb + (lr + 8 * rr) * FX_VI8_P * 4;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            const int c = nb + t * 8 + tig * 2;
            row[c] = (signed char)fx_q8(a[rr][t][0], inv);
            row[c + 1] = (signed char)fx_q8(a[rr][t][1], inv);
        }
    }
}

// Sum of this thread's two rows' values over the whole block row. Synchronises.
__device__ __forceinline__ void fx_vi8_row_sums(const float (&v)[2], float (&sum)[2], float (*red)[2], int lr, int nh,
                                                int tig) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float m = v[rr];
        m += __shfl_xor_sync(0xffffffffu, m, 1);
        m += __shfl_xor_sync(0xffffffffu, m, 2);
        if (tig == 0) red[lr + 8 * rr][nh] = m;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) sum[rr] = red[lr + 8 * rr][0] + red[lr + 8 * rr][1];
}

// grid (ceil(rows / 64), groups) of 256 threads. Block (b, g) takes rows 64b .. 64b + 63
// through variables [g·n/groups, (g+1)·n/groups) and writes their partial mix to
// out + g·rows·d (groups = 1: the mix itself; else fx_tft_vsn_reduce sums the groups in
// order). Warp w computes rows 16 (w & 3) .. + 15, columns 64 (w >> 2) .. + 63 of each
// product (d a multiple of 4 up to 128; K is zero-padded to a multiple of 32).
// Row r of variable j: a1 = ELU(raw[r, j] u1[j] + c1[j]); a2 = q(a1) W2[j]ᵀ dequantised
// + b2[j]; g4, g5 = q(a2) W4[j]ᵀ, q(a2) W5[j]ᵀ dequantised + b4[j], b5[j];
// z = raw[r, j] w_emb[j] + b_emb[j] + σ(g4) ⊙ g5; out[r] = Σ_j wsel[r, j] LN_j(z).
// in2 / in45 ([n] calibrated input steps of fc2 and of fc4 = fc5) may be null: dynamic.
extern "C" __global__ void __launch_bounds__(256, 2)
fx_tft_vsn_vars_i8(fx_u32 rows, fx_u32 n, fx_u32 d, fx_u32 groups, const float* __restrict__ raw,
                   const float* __restrict__ emb_w, const float* __restrict__ emb_b,
                   const float* __restrict__ u1, const float* __restrict__ c1,
                   const int* __restrict__ w2, const int* __restrict__ w4, const int* __restrict__ w5,
                   const float* __restrict__ ws2, const float* __restrict__ ws4,
                   const float* __restrict__ ws5, const float* __restrict__ b2,
                   const float* __restrict__ b4, const float* __restrict__ b5,
                   const float* __restrict__ in2, const float* __restrict__ in45,
                   const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps,
                   const float* __restrict__ wsel, float* __restrict__ out) {
    __shared__ __align__(16) int qa[FX_VI8_ROWS * FX_VI8_P];
    __shared__ __align__(16) int wa[FX_VI8_MAXD * FX_VI8_P];
    __shared__ __align__(16) int wb[FX_VI8_MAXD * FX_VI8_P];
    __shared__ float red[2][FX_VI8_ROWS][2];
    signed char* qb = (signed char*)qa;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int m0 = (warp & 3) * 16, nh = warp >> 2, nb = nh * 64;
    const int lr = m0 + g;  // this thread's block rows: lr, lr + 8
    const fx_u32 kw = ((d + 31) / 32) * 8, ksteps = kw / 8;
    const fx_u64 mat = (fx_u64)d * (d >> 2);  // words per matrix
    const fx_u32 j0 = blockIdx.y * n / groups, j1 = (blockIdx.y + 1) * n / groups;
    fx_u64 row[2];
    bool live[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        row[rr] = (fx_u64)blockIdx.x * FX_VI8_ROWS + lr + 8 * rr;
        live[rr] = row[rr] < rows;
    }
    float acc_out[2][8][2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
        for (int t = 0; t < 8; ++t) acc_out[rr][t][0] = acc_out[rr][t][1] = 0.0f;

    for (fx_u32 j = j0; j < j1; ++j) {
        const fx_u64 jd = (fx_u64)j * d;
        float x[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) x[rr] = live[rr] ? raw[row[rr] * n + j] : 0.0f;

        // fc1 (folded) + ELU, quantised for fc2 (columns from d on are 0: K's padding).
        float a[2][8][2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const fx_u32 c = nb + t * 8 + tig * 2 + e;
                    a[rr][t][e] = c < d ? fx_vi8_elu(__fadd_rn(__fmul_rn(x[rr], u1[jd + c]), c1[jd + c])) : 0.0f;
                }
        fx_vi8_load(wa, w2 + j * mat, d, kw);
        float s1[2];
        fx_vi8_steps(a, in2 ? in2[j] : 0.0f, s1, red[0], lr, nh, tig);
        fx_vi8_store(a, s1, qb, lr, nb, tig);
        __syncthreads();

        // fc2: exact int32 sums, dequantised, + b2.
        {
            int acc[8][4];
            fx_vi8_gemm(acc, qa, wa, m0, nb, lane, ksteps);
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                for (int t = 0; t < 8; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const fx_u32 c = nb + t * 8 + tig * 2 + e;
                        a[rr][t][e] = c < d ? fx_dq8(acc[t][rr * 2 + e], ws2[jd + c], s1[rr], b2[jd + c])
                                            : 0.0f;
                    }
        }
        // fc4 and fc5 share the quantised a2 (the steps' barrier also ends fc2's reads).
        float s2[2];
        fx_vi8_steps(a, in45 ? in45[j] : 0.0f, s2, red[1], lr, nh, tig);
        fx_vi8_load(wa, w4 + j * mat, d, kw);
        fx_vi8_load(wb, w5 + j * mat, d, kw);
        fx_vi8_store(a, s2, qb, lr, nb, tig);
        __syncthreads();
        // fc4 first, kept as σ(g4) in a; then fc5 into the same accumulators (registers).
        float part[2] = {0.0f, 0.0f};
        {
            int acc[8][4];
            fx_vi8_gemm(acc, qa, wa, m0, nb, lane, ksteps);
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                for (int t = 0; t < 8; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const fx_u32 c = nb + t * 8 + tig * 2 + e;
                        a[rr][t][e] = c < d ? fx_vi8_sigmoid(fx_dq8(acc[t][rr * 2 + e], ws4[jd + c], s2[rr], b4[jd + c]))
                                            : 0.0f;
                    }
            fx_vi8_gemm(acc, qa, wb, m0, nb, lane, ksteps);
            // GLU over the embedding's residual (z, in a), then the variable's LayerNorm.
#pragma unroll
            for (int rr = 0; rr < 2; ++rr)
#pragma unroll
                for (int t = 0; t < 8; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const fx_u32 c = nb + t * 8 + tig * 2 + e;
                        float z = 0.0f;
                        if (c < d) {
                            const float g5 = fx_dq8(acc[t][rr * 2 + e], ws5[jd + c], s2[rr], b5[jd + c]);
                            const float em = __fadd_rn(__fmul_rn(x[rr], emb_w[jd + c]), emb_b[jd + c]);
                            z = __fadd_rn(em, __fmul_rn(a[rr][t][e], g5));
                        }
                        a[rr][t][e] = z;
                        part[rr] += z;
                    }
        }
        float mean[2];
        fx_vi8_row_sums(part, mean, red[0], lr, nh, tig);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            mean[rr] /= (float)d;
            part[rr] = 0.0f;
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (nb + t * 8 + tig * 2 + e < (int)d) {
                        const float dv = a[rr][t][e] - mean[rr];
                        part[rr] += dv * dv;
                    }
        }
        float var[2];
        fx_vi8_row_sums(part, var, red[1], lr, nh, tig);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const float rstd = 1.0f / sqrtf(var[rr] / (float)d + eps);
            const float wj = live[rr] ? wsel[row[rr] * n + j] : 0.0f;
#pragma unroll
            for (int t = 0; t < 8; ++t)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const fx_u32 c = nb + t * 8 + tig * 2 + e;
                    if (c < d) acc_out[rr][t][e] += wj * ((a[rr][t][e] - mean[rr]) * rstd * ln_w[jd + c] + ln_b[jd + c]);
                }
        }
    }
    float* dst = out + (fx_u64)blockIdx.y * rows * d;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        if (!live[rr]) continue;
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const fx_u32 c = nb + t * 8 + tig * 2 + e;
                if (c < d) dst[row[rr] * d + c] = acc_out[rr][t][e];
            }
    }
}

// out[i] = Σ_g part[g · len + i] in group order (the variable groups' partial mixes).
extern "C" __global__ void fx_tft_vsn_reduce(const float* __restrict__ part, fx_u32 groups, fx_u64 len,
                                             float* __restrict__ out) {
    for (fx_u64 i = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (fx_u64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (fx_u32 g = 0; g < groups; ++g) s += part[(fx_u64)g * len + i];
        out[i] = s;
    }
}
