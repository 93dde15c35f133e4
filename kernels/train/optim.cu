// The training step after backward, entirely on the device, so it can be captured in a
// CUDA graph and never reads to the host (crates/fx-precision/src/fused/kernels.rs launches
// these; crates/fx-precision/src/fused_ref.rs is the CPU reference they are tested against):
//   1. fx_mt_sumsq     per-block partial sums of g^2 over many gradient tensors (one launch
//                      per table of up to FX_MT_MAX tensors);
//   2. fx_step_finalize one block: total squared norm (double, fixed order), the NaN/Inf
//                      guard, clip factor, step count, bias corrections, GradScaler update
//                      and running statistics, all in the control block `ctrl` (double);
//   3. fx_mt_adam      Adam / AdamW on every tensor with the factors of 2 (a no-op when 2
//                      decided to skip), then optionally the soft target update
//                      target += tau (param - target).
// Host scalars (learning rate, step count) live in `ctrl`, so a replayed graph follows
// schedules and counts steps. `dry` launches (graph warm-up) touch no state.

#include "fx_block_sum.cuh"

#define FX_MT_MAX 24
#define FX_MT_BLOCK 256
#define FX_MT_ITEMS 8
#define FX_MT_CHUNK (FX_MT_BLOCK * FX_MT_ITEMS)
#define FX_MAX_EXTRA 8

// Control block layout (doubles); mirrored by `Ctrl` in crates/fx-precision/src/fused/kernels.rs.
#define C_LR 0
#define C_STEP 1
#define C_SCALE 2
#define C_GROWTH 3
#define C_APPLIED 4
#define C_SKIP_LOSS 5
#define C_SKIP_GRAD 6
#define C_LAST_LOSS 7
#define C_LAST_NORM 8
#define C_LAST_SKIPPED 9
#define C_COEF 10
#define C_STEP_SIZE 11
#define C_INV_BC2_SQRT 12
#define C_LOSS_SUM 13
#define C_LOSS_COUNT 14
#define C_CLIPPED 15
#define C_DECAY 16
#define C_NORM_SUM 17
#define C_EXTRA_LAST 24
#define C_EXTRA_SUM 32
#define C_LEN 40

// Up to FX_MT_MAX tensors of one launch: addresses (0 where unused), lengths, and the first
// block of each tensor (block_start[n] = blocks of the launch).
struct MtTable {
    unsigned long long param[FX_MT_MAX];
    unsigned long long grad[FX_MT_MAX];
    unsigned long long exp_avg[FX_MT_MAX];
    unsigned long long exp_avg_sq[FX_MT_MAX];
    unsigned long long target[FX_MT_MAX];
    unsigned int len[FX_MT_MAX];
    unsigned int block_start[FX_MT_MAX + 1];
    unsigned int n;
};

struct StepConsts {
    double max_norm;         // <= 0: no clipping
    double beta1, beta2;
    double weight_decay;
    double growth_factor, backoff_factor;
    unsigned int growth_interval;
    unsigned int scaler_enabled;
    unsigned int n_extra;
    unsigned long long extra[FX_MAX_EXTRA];  // F32 scalars read into C_EXTRA_*
};

__device__ __forceinline__ unsigned int mt_tensor(const MtTable& t, unsigned int b) {
    unsigned int i = 0;
    while (i + 1 < t.n && t.block_start[i + 1] <= b) ++i;
    return i;
}


extern "C" __global__ void __launch_bounds__(FX_MT_BLOCK)
fx_mt_sumsq(MtTable t, float* __restrict__ partials, unsigned int partial_offset) {
    __shared__ float smem[32];
    unsigned int b = blockIdx.x;
    unsigned int i = mt_tensor(t, b);
    const float* g = (const float*)t.grad[i];
    size_t base = (size_t)(b - t.block_start[i]) * FX_MT_CHUNK;
    size_t len = t.len[i];
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < FX_MT_ITEMS; ++k) {
        size_t j = base + (size_t)k * FX_MT_BLOCK + threadIdx.x;
        if (j < len) {
            float x = g[j];
            acc = fmaf(x, x, acc);
        }
    }
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) partials[partial_offset + b] = acc;
}

// One block. `scale32` (may be 0) receives the new loss scale as F32 for the next step's
// scaled loss.
extern "C" __global__ void fx_step_finalize(const float* __restrict__ partials, unsigned int n_partials,
                                            const float* __restrict__ loss, double* __restrict__ ctrl,
                                            float* __restrict__ scale32, StepConsts c, unsigned int dry) {
    __shared__ double smem[FX_MT_BLOCK];
    double acc = 0.0;
    for (unsigned int k = threadIdx.x; k < n_partials; k += blockDim.x) acc += (double)partials[k];
    smem[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x != 0 || dry) return;
    double scale = ctrl[C_SCALE];
    // PyTorch: inv_scale = float(1 / double(scale)).
    double inv = (double)(float)(1.0 / scale);
    double sumsq = smem[0] * inv * inv;
    double norm = sqrt(sumsq);
    double l = (double)loss[0];
    int skip = 0;
    if (!isfinite(l)) skip = 1;
    else if (!isfinite(sumsq)) skip = 2;
    ctrl[C_LAST_LOSS] = l;
    ctrl[C_LAST_NORM] = norm;
    ctrl[C_LAST_SKIPPED] = skip ? 1.0 : 0.0;
    if (skip) {
        ctrl[skip == 1 ? C_SKIP_LOSS : C_SKIP_GRAD] += 1.0;
        ctrl[C_COEF] = 0.0;
        if (c.scaler_enabled) {
            scale *= c.backoff_factor;
            ctrl[C_GROWTH] = 0.0;
        }
    } else {
        double coef = inv;
        if (c.max_norm > 0.0) {
            double clip = c.max_norm / (norm + 1e-6);
            if (clip < 1.0) {
                coef *= clip;
                ctrl[C_CLIPPED] += 1.0;
            }
        }
        double t = ctrl[C_STEP] + 1.0;
        double lr = ctrl[C_LR];
        ctrl[C_STEP] = t;
        ctrl[C_APPLIED] += 1.0;
        ctrl[C_COEF] = coef;
        ctrl[C_STEP_SIZE] = lr / (1.0 - pow(c.beta1, t));
        ctrl[C_INV_BC2_SQRT] = 1.0 / sqrt(1.0 - pow(c.beta2, t));
        ctrl[C_DECAY] = 1.0 - lr * c.weight_decay;
        ctrl[C_LOSS_SUM] += l;
        ctrl[C_LOSS_COUNT] += 1.0;
        ctrl[C_NORM_SUM] += norm;
        if (c.scaler_enabled) {
            double g = ctrl[C_GROWTH] + 1.0;
            if (g >= (double)c.growth_interval) {
                scale *= c.growth_factor;
                g = 0.0;
            }
            ctrl[C_GROWTH] = g;
        }
    }
    ctrl[C_SCALE] = scale;
    if (scale32) scale32[0] = (float)scale;
    // The sums, like the loss's, cover the applied steps only (a skipped step's
    // diagnostics may be NaN).
    for (unsigned int k = 0; k < c.n_extra && k < FX_MAX_EXTRA; ++k) {
        double v = (double)((const float*)c.extra[k])[0];
        ctrl[C_EXTRA_LAST + k] = v;
        if (!skip) ctrl[C_EXTRA_SUM + k] += v;
    }
}

// The rounding follows the eager candle ops of crates/fx-precision/src/optim.rs step by step.
// decoupled = 1: AdamW (p *= 1 - lr wd before the update); 0: Adam with wd as L2 in g.
extern "C" __global__ void __launch_bounds__(FX_MT_BLOCK)
fx_mt_adam(MtTable t, const double* __restrict__ ctrl, float beta1, float one_minus_beta1, float beta2,
           float one_minus_beta2, float eps, float weight_decay, unsigned int decoupled, float tau,
           unsigned int dry) {
    if (dry || ctrl[C_LAST_SKIPPED] != 0.0) return;
    float coef = (float)ctrl[C_COEF];
    float step_size = (float)ctrl[C_STEP_SIZE];
    float inv_bc2 = (float)ctrl[C_INV_BC2_SQRT];
    float decay = (float)ctrl[C_DECAY];
    unsigned int b = blockIdx.x;
    unsigned int i = mt_tensor(t, b);
    float* p = (float*)t.param[i];
    const float* g = (const float*)t.grad[i];
    float* m = (float*)t.exp_avg[i];
    float* v = (float*)t.exp_avg_sq[i];
    float* tg = (float*)t.target[i];
    size_t base = (size_t)(b - t.block_start[i]) * FX_MT_CHUNK;
    size_t len = t.len[i];
#pragma unroll
    for (int k = 0; k < FX_MT_ITEMS; ++k) {
        size_t j = base + (size_t)k * FX_MT_BLOCK + threadIdx.x;
        if (j >= len) continue;
        float gj = __fmul_rn(g[j], coef);
        float pj = p[j];
        if (weight_decay != 0.0f) {
            if (decoupled) pj = __fmul_rn(pj, decay);
            else gj = __fadd_rn(gj, __fmul_rn(pj, weight_decay));
        }
        float mj = __fadd_rn(__fmul_rn(m[j], beta1), __fmul_rn(gj, one_minus_beta1));
        float vj = __fadd_rn(__fmul_rn(v[j], beta2), __fmul_rn(__fmul_rn(gj, gj), one_minus_beta2));
        // fmaf: candle's affine (the eager path) is x * mul + add, contracted to one FMA.
        float denom = fmaf(sqrtf(vj), inv_bc2, eps);
        pj = __fsub_rn(pj, __fmul_rn(__fdiv_rn(mj, denom), step_size));
        p[j] = pj;
        m[j] = mj;
        v[j] = vj;
        if (tg) tg[j] = __fadd_rn(tg[j], __fmul_rn(__fsub_rn(pj, tg[j]), tau));
    }
}
