// The optimiser tail of a population's update (N members of one architecture, every tensor
// stacked [N, per]), entirely on the device (crates/fx-precision/src/fused/pop_kernels.rs
// launches these; crates/fx-precision/src/fused_ref.rs's pop_adam_reference is the CPU
// reference they are tested against):
//   1. fx_pop_sumsq  per-block partial sums of g^2, one row of partials per member, over up
//                    to FX_MT_MAX tensors (a member's partials in a fixed order, so its norm
//                    does not depend on the other members);
//   2. (the caller)  per member: the guard, clip factor, step count and bias corrections
//                    from the partials, as [N] tensors;
//   3. fx_pop_adam   AdamW on every tensor with member k's factors, skipped where member k's
//                    ok flag is 0, then the soft target update target += tau_k (p - target).
// Per-member values are device arrays, so a captured graph serves any mix of members.

#include "fx_block_sum.cuh"

#define FX_MT_MAX 24
#define FX_MT_BLOCK 256
#define FX_MT_ITEMS 8
#define FX_MT_CHUNK (FX_MT_BLOCK * FX_MT_ITEMS)

// Up to FX_MT_MAX stacked tensors: addresses (target 0 where none), each member's length,
// the first block of each tensor and the first partial (column) of each tensor in a
// member's row of partials.
struct PopTable {
    unsigned long long param[FX_MT_MAX];
    unsigned long long grad[FX_MT_MAX];
    unsigned long long exp_avg[FX_MT_MAX];
    unsigned long long exp_avg_sq[FX_MT_MAX];
    unsigned long long target[FX_MT_MAX];
    unsigned int per[FX_MT_MAX];
    unsigned int block_start[FX_MT_MAX + 1];
    unsigned int col_start[FX_MT_MAX];
    unsigned int n;
    unsigned int members;
    unsigned int cols;
};

// Per-member values of the step, F32 [members] each.
struct PopFactors {
    unsigned long long ok;            // 1: apply, 0: skip the member
    unsigned long long coef;          // gradient factor (clip)
    unsigned long long decay;         // 1 - lr wd
    unsigned long long step_size;     // lr / (1 - beta1^t)
    unsigned long long inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t)
    unsigned long long tau;           // soft target update
};

// Block b of the launch: its tensor i, member k and chunk c within the member's slice.
__device__ __forceinline__ void pop_block(const PopTable& t, unsigned int b, unsigned int& i, unsigned int& k,
                                          unsigned int& c) {
    i = 0;
    while (i + 1 < t.n && t.block_start[i + 1] <= b) ++i;
    unsigned int chunks = (t.per[i] + FX_MT_CHUNK - 1) / FX_MT_CHUNK;
    unsigned int r = b - t.block_start[i];
    k = r / chunks;
    c = r % chunks;
}


// partials: F32 [members, cols]; member k's partial of tensor i, chunk c at
// k * cols + col_start[i] + c. A non-finite gradient makes its partial non-finite.
extern "C" __global__ void __launch_bounds__(FX_MT_BLOCK)
fx_pop_sumsq(PopTable t, float* __restrict__ partials) {
    __shared__ float smem[32];
    unsigned int i, k, c;
    pop_block(t, blockIdx.x, i, k, c);
    size_t per = t.per[i];
    const float* g = (const float*)t.grad[i] + (size_t)k * per;
    size_t base = (size_t)c * FX_MT_CHUNK;
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q < FX_MT_ITEMS; ++q) {
        size_t j = base + (size_t)q * FX_MT_BLOCK + threadIdx.x;
        if (j < per) {
            float x = g[j];
            acc = fmaf(x, x, acc);
        }
    }
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) partials[(size_t)k * t.cols + t.col_start[i] + c] = acc;
}

// The rounding follows the population's candle ops (crates/fx-models/src/dqn/population.rs):
// g' = g coef; p' = p decay; m = m b1 + g' (1 - b1); v = v b2 + g'^2 (1 - b2);
// p' -= m / (sqrt(v) inv_bc2 + eps) step_size; target += (p' - target) tau.
extern "C" __global__ void __launch_bounds__(FX_MT_BLOCK)
fx_pop_adam(PopTable t, PopFactors f, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
            float eps, unsigned int dry) {
    if (dry) return;
    unsigned int i, k, c;
    pop_block(t, blockIdx.x, i, k, c);
    if (((const float*)f.ok)[k] == 0.0f) return;
    float coef = ((const float*)f.coef)[k];
    float decay = ((const float*)f.decay)[k];
    float step_size = ((const float*)f.step_size)[k];
    float inv_bc2 = ((const float*)f.inv_bc2_sqrt)[k];
    float tau = ((const float*)f.tau)[k];
    size_t per = t.per[i];
    size_t off = (size_t)k * per;
    float* p = (float*)t.param[i] + off;
    const float* g = (const float*)t.grad[i] + off;
    float* m = (float*)t.exp_avg[i] + off;
    float* v = (float*)t.exp_avg_sq[i] + off;
    float* tg = t.target[i] ? (float*)t.target[i] + off : 0;
    size_t base = (size_t)c * FX_MT_CHUNK;
#pragma unroll
    for (int q = 0; q < FX_MT_ITEMS; ++q) {
        size_t j = base + (size_t)q * FX_MT_BLOCK + threadIdx.x;
        if (j >= per) continue;
        float gj = __fmul_rn(g[j], coef);
        float pj = __fmul_rn(p[j], decay);
        // candle's affine is x * mul + add, one FMA: m b1 + (g (1 - b1)) with the product
        // of the second term rounded first.
        float mj = __fadd_rn(__fmul_rn(m[j], beta1), __fmul_rn(gj, one_minus_beta1));
        float vj = __fadd_rn(__fmul_rn(v[j], beta2), __fmul_rn(__fmul_rn(gj, gj), one_minus_beta2));
        float denom = __fadd_rn(__fmul_rn(sqrtf(vj), inv_bc2), eps);
        pj = __fsub_rn(pj, __fmul_rn(__fdiv_rn(mj, denom), step_size));
        p[j] = pj;
        m[j] = mj;
        v[j] = vj;
        if (tg) tg[j] = __fadd_rn(tg[j], __fmul_rn(__fsub_rn(pj, tg[j]), tau));
    }
}
