// The optimiser tail of a population's update (N members of one architecture, every tensor
// stacked [N, per]), entirely on the device (crates/fx-precision/src/fused/pop_kernels.rs
// launches these; crates/fx-precision/src/fused_ref.rs's pop_adam_reference is the CPU
// reference they are tested against):
//   1. fx_pop_sumsq  per-block partial sums of g^2, one row of partials per member, over up
//                    to FX_MT_MAX tensors (a member's partials in a fixed order, so its norm
//                    does not depend on the other members);
//   2. fx_pop_decide per member (a thread each): the guard, clip factor, step count and
//                    bias corrections from its row of partials, as [N] arrays, and its
//                    counters and last report (one launch, where candle's ops took ~40 tiny
//                    launches that a captured step paid one by one);
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

// The inputs and outputs of fx_pop_decide (member k at index k of every [members] array).
struct PopDecide {
    unsigned long long partials;      // F32 [members, cols] (fx_pop_sumsq's)
    unsigned long long loss;          // F32 [members]
    unsigned long long lr;            // F64 [members]
    unsigned long long max_norm;      // F64 [members]
    unsigned long long bc1;           // F64 [bc1_last + 1]: 1 - beta1^t
    unsigned long long bc2;           // F64 [bc2_last + 1]: 1 - beta2^t
    unsigned long long steps;         // U32 [members], in and out: steps applied
    unsigned long long skipped_loss;  // U32 [members], in and out
    unsigned long long skipped_grad;  // U32 [members], in and out
    unsigned long long last;          // F64 [3, members] out: loss, gradient norm, skipped
    unsigned long long active;        // F32 [members]: 0 where the member is not learning yet
                                      //   (it steps nothing and counts no skip)
    unsigned long long ok;            // F32 [members] out: PopFactors' ok, coef, step_size,
    unsigned long long coef;          //   inv_bc2_sqrt
    unsigned long long step_size;
    unsigned long long inv_bc2_sqrt;
    unsigned int bc1_last;
    unsigned int bc2_last;
    unsigned int members;
    unsigned int cols;
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

// Member k's decisions, rounding as the CPU path's candle ops (PopAdamW::decide) round, with
// the squared norm summed in F32 over the member's partials in column order:
//   ok = loss and sumsq finite; norm = sqrt(sumsq) (F32, then F64);
//   coef = min(max_norm / (norm + 1e-6), 1) (F64, a NaN quotient gives 1; then F32);
//   steps += ok; step_size = lr / bc1[min(steps, bc1_last)]; inv_bc2_sqrt = 1 / sqrt(bc2[..]).
// A dry launch (a graph's warm-up) writes the four factor arrays only, never the counters.
extern "C" __global__ void fx_pop_decide(PopDecide d, unsigned int dry) {
    unsigned int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= d.members) return;
    const float* row = (const float*)d.partials + (size_t)k * d.cols;
    float sumsq = 0.0f;
    for (unsigned int c = 0; c < d.cols; ++c) sumsq = __fadd_rn(sumsq, row[c]);
    float loss = ((const float*)d.loss)[k];
    // x - x is 0 exactly for finite x and NaN otherwise.
    bool ok_loss = __fsub_rn(loss, loss) == 0.0f;
    bool ok_grad = __fsub_rn(sumsq, sumsq) == 0.0f;
    const bool active = ((const float*)d.active)[k] != 0.0f;
    bool ok = active && ok_loss && ok_grad;
    double norm = (double)__fsqrt_rn(sumsq);
    double q = __ddiv_rn(((const double*)d.max_norm)[k], __dadd_rn(norm, 1e-6));
    float coef = q < 1.0 ? __double2float_rn(q) : 1.0f;
    unsigned int* steps = (unsigned int*)d.steps;
    unsigned int t = steps[k] + (ok ? 1u : 0u);
    unsigned int i1 = t < d.bc1_last ? t : d.bc1_last;
    unsigned int i2 = t < d.bc2_last ? t : d.bc2_last;
    ((float*)d.ok)[k] = ok ? 1.0f : 0.0f;
    ((float*)d.coef)[k] = coef;
    ((float*)d.step_size)[k] = __double2float_rn(__ddiv_rn(((const double*)d.lr)[k], ((const double*)d.bc1)[i1]));
    ((float*)d.inv_bc2_sqrt)[k] = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(((const double*)d.bc2)[i2])));
    if (dry) return;
    steps[k] = t;
    ((unsigned int*)d.skipped_loss)[k] += (active && !ok_loss) ? 1u : 0u;
    ((unsigned int*)d.skipped_grad)[k] += (active && ok_loss && !ok_grad) ? 1u : 0u;
    double* last = (double*)d.last;
    last[k] = (double)loss;
    last[d.members + k] = norm;
    last[2 * (size_t)d.members + k] = ok ? 0.0 : 1.0;
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
