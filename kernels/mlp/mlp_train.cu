// Element-wise and loss kernels of the fused MLP training step (crates/fx-models/src/mlp/
// train_cuda.rs); the GEMMs around them are cuBLAS calls. Row-major [rows, cols] F32 buffers.
// The reference these are tested against is the candle DQN update (fx-models device tests).
// fx_bias_act, fx_act_bwd, fx_dqn_head_loss and fx_ppo_loss also serve populations:
// blockIdx.y is the member (blockIdx.x for fx_ppo_adv_stats), whose buffers follow the
// previous member's (a solo step launches one member).

#include <cuda_bf16.h>

#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_TANH 2

// h = act(h + b) in place; b has `cols` entries. `h16` (may be 0) receives a BF16 copy, the
// next layer's GEMM input under BF16 compute. With h null, h16 is the input and the output
// (a GEMM's BF16 output: act(x + b) in F32, rounded once more). Member m: h [m][rows, cols],
// b [m][cols].
extern "C" __global__ void fx_bias_act(float* __restrict__ h, const float* __restrict__ b, unsigned int rows,
                                       unsigned int cols, unsigned int act, __nv_bfloat16* __restrict__ h16) {
    size_t n = (size_t)rows * cols;
    if (h) h += blockIdx.y * n;
    b += (size_t)blockIdx.y * cols;
    if (h16) h16 += blockIdx.y * n;
    // The column follows the index by additions, not a 64-bit modulo per element (which made
    // this memory-bound kernel compute-bound): i advances by `stride`, the column by
    // stride % cols, wrapped once.
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned int col = (unsigned int)(i % cols), step = (unsigned int)(stride % cols);
    for (; i < n; i += stride) {
        float x = (h ? h[i] : __bfloat162float(h16[i])) + b[col];
        col += step;
        if (col >= cols) col -= cols;
        if (act == ACT_RELU) x = x > 0.0f ? x : 0.0f;
        else if (act == ACT_TANH) x = tanhf(x);
        if (h) h[i] = x;
        if (h16) h16[i] = __float2bfloat16_rn(x);
    }
}

// Up to 8 F32 → BF16 conversions in one launch (weights and inputs under BF16 compute).
struct CastTable {
    unsigned long long src[8];
    unsigned long long dst[8];
    unsigned int len[8];
    unsigned int n;
};

extern "C" __global__ void fx_cast_bf16(CastTable t) {
    for (unsigned int k = 0; k < t.n; ++k) {
        const float* s = (const float*)t.src[k];
        __nv_bfloat16* d = (__nv_bfloat16*)t.dst[k];
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < t.len[k]; i += (size_t)gridDim.x * blockDim.x)
            d[i] = __float2bfloat16_rn(s[i]);
    }
}

// dh *= act'(h) in place, where h is the layer's output after the activation; `dh16` (may
// be 0) receives a BF16 copy. Member m: dh (and dh16) [m][rows, cols], h at m·h_stride
// (a member's h may hold more rows than its gradient: the DQN's online rows on s and s').
// With `h16` set, h is read from that BF16 copy instead (`h` unused): a ReLU's mask is the
// same on it (rounding keeps the sign; only an F32 subnormal can round to 0), and a GEMM
// epilogue or the split forward, which write only the BF16 activation, leave no F32 one
// (tanh's 1 - y^2 is then that of the BF16 y).
extern "C" __global__ void fx_act_bwd(float* __restrict__ dh, const float* __restrict__ h, unsigned int rows,
                                      unsigned int cols, unsigned int act, __nv_bfloat16* __restrict__ dh16,
                                      unsigned long long h_stride, const __nv_bfloat16* __restrict__ h16) {
    size_t n = (size_t)rows * cols;
    dh += blockIdx.y * n;
    if (h16) h16 += blockIdx.y * h_stride;
    else h += blockIdx.y * h_stride;
    if (dh16) dh16 += blockIdx.y * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float y = h16 ? __bfloat162float(h16[i]) : h[i];
        float g = dh[i];
        if (act == ACT_RELU) g = y > 0.0f ? g : 0.0f;
        else if (act == ACT_TANH) g = g * (1.0f - y * y);
        dh[i] = g;
        if (dh16) dh16[i] = __float2bfloat16_rn(g);
    }
}

#define DQN_MAX_A 8

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Dueling heads of one trunk output row z [k]: Q_a = v + adv_a - mean(adv). Every lane gets
// the values (warp-wide sums).
__device__ __forceinline__ void dueling(const float* __restrict__ z, const float* __restrict__ wv, float bv,
                                        const float* __restrict__ wa, const float* __restrict__ ba, unsigned int k,
                                        unsigned int na, float* q) {
    int lane = threadIdx.x & 31;
    float v = 0.0f;
    for (unsigned int j = lane; j < k; j += 32) v = fmaf(z[j], wv[j], v);
    v = warp_sum(v) + bv;
    float mean = 0.0f;
    for (unsigned int a = 0; a < na; ++a) {
        float s = 0.0f;
        for (unsigned int j = lane; j < k; j += 32) s = fmaf(z[j], wa[(size_t)a * k + j], s);
        q[a] = warp_sum(s) + ba[a];
        mean += q[a];
    }
    mean /= (float)na;
    for (unsigned int a = 0; a < na; ++a) q[a] = v + (q[a] - mean);
}

// One warp per transition i < B. z_on: online trunk outputs [2B, k] (rows 0..B: s, rows B..2B:
// s'); z_tg: target trunk outputs on s' [B, k]. Writes the Huber loss per row (mean taken by
// the caller), d_out [B, 1 + na] (dL/dvalue, dL/dadv_a: the head gradients) and dz [B, k]
// (dL/dz times the trunk's ReLU mask). Double DQN: a* = argmax Q_online(s') (first max),
// y = r + gamma (1 - done) Q_target(s', a*), no gradient through y.
// Member m = blockIdx.y: every buffer at member m's block (z_on [m][2B, k], heads [m][...],
// transitions [m][B], outputs [m][...]); its gamma is gamma_m[m] when gamma_m is not 0.
extern "C" __global__ void fx_dqn_head_loss(const float* __restrict__ z_on, const float* __restrict__ z_tg,
                                            const float* __restrict__ wv, const float* __restrict__ bv,
                                            const float* __restrict__ wa, const float* __restrict__ ba,
                                            const float* __restrict__ wv_t, const float* __restrict__ bv_t,
                                            const float* __restrict__ wa_t, const float* __restrict__ ba_t,
                                            const unsigned int* __restrict__ actions, const float* __restrict__ rewards,
                                            const float* __restrict__ dones, unsigned int B, unsigned int k,
                                            unsigned int na, float gamma, float delta, float* __restrict__ loss_rows,
                                            float* __restrict__ d_out, float* __restrict__ dz,
                                            __nv_bfloat16* __restrict__ dz16, const float* __restrict__ gamma_m) {
    size_t m = blockIdx.y, bk = (size_t)B * k;
    z_on += 2 * m * bk;
    z_tg += m * bk;
    wv += m * k;
    bv += m;
    wa += m * na * k;
    ba += m * na;
    wv_t += m * k;
    bv_t += m;
    wa_t += m * na * k;
    ba_t += m * na;
    actions += m * B;
    rewards += m * B;
    dones += m * B;
    loss_rows += m * B;
    d_out += m * B * (1 + na);
    dz += m * bk;
    if (dz16) dz16 += m * bk;
    if (gamma_m) gamma = gamma_m[m];
    unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    int lane = threadIdx.x & 31;
    for (unsigned int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < B; i += warps) {
        float q[DQN_MAX_A], qn[DQN_MAX_A], qt[DQN_MAX_A];
        const float* z = z_on + (size_t)i * k;
        dueling(z, wv, bv[0], wa, ba, k, na, q);
        dueling(z_on + (size_t)(B + i) * k, wv, bv[0], wa, ba, k, na, qn);
        dueling(z_tg + (size_t)i * k, wv_t, bv_t[0], wa_t, ba_t, k, na, qt);
        unsigned int best = 0;
        for (unsigned int a = 1; a < na; ++a)
            if (qn[a] > qn[best]) best = a;
        unsigned int act = actions[i];
        if (act >= na) act = na - 1;  // actions are validated by the replay; keep the read in bounds
        float y = rewards[i] + gamma * (1.0f - dones[i]) * qt[best];
        float d = q[act] - y;
        float ad = fabsf(d);
        float loss = ad <= delta ? 0.5f * d * d : delta * (ad - 0.5f * delta);
        // dL/dq_sa of the mean Huber loss.
        float g = (ad <= delta ? d : (d > 0.0f ? delta : (d < 0.0f ? -delta : 0.0f))) / (float)B;
        if (d != d) g = d;  // NaN propagates (the guard then skips the step)
        float dadv_common = -g / (float)na;
        if (lane == 0) {
            loss_rows[i] = loss;
            float* o = d_out + (size_t)i * (1 + na);
            o[0] = g;
            for (unsigned int a = 0; a < na; ++a) o[1 + a] = dadv_common + (a == act ? g : 0.0f);
        }
        for (unsigned int j = lane; j < k; j += 32) {
            float s = g * wv[j];
            for (unsigned int a = 0; a < na; ++a) s = fmaf(dadv_common + (a == act ? g : 0.0f), wa[(size_t)a * k + j], s);
            float v = z[j] > 0.0f ? s : 0.0f;
            dz[(size_t)i * k + j] = v;
            if (dz16) dz16[(size_t)i * k + j] = __float2bfloat16_rn(v);
        }
    }
}

// Dueling Q values of B trunk outputs z [B, k] (the DQN forward's head, for collection):
// q [B, na] row-major, one warp per row, the same arithmetic as the update's heads.
extern "C" __global__ void fx_dqn_q(const float* __restrict__ z, const float* __restrict__ wv,
                                    const float* __restrict__ bv, const float* __restrict__ wa,
                                    const float* __restrict__ ba, unsigned int B, unsigned int k, unsigned int na,
                                    float* __restrict__ q) {
    unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    int lane = threadIdx.x & 31;
    for (unsigned int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < B; i += warps) {
        float qi[DQN_MAX_A];
        dueling(z + (size_t)i * k, wv, bv[0], wa, ba, k, na, qi);
        if (lane == 0)
            for (unsigned int a = 0; a < na; ++a) q[(size_t)i * na + a] = qi[a];
    }
}

// PPO: advantage mean and unbiased standard deviation of one minibatch (one block, double).
// stats[0] = mean, stats[1] = std. Member m = blockIdx.x: adv [m][B], stats [m][2].
extern "C" __global__ void fx_ppo_adv_stats(const float* __restrict__ adv, unsigned int B, float* __restrict__ stats) {
    __shared__ double s1[256], s2[256];
    adv += (size_t)blockIdx.x * B;
    stats += 2 * (size_t)blockIdx.x;
    double a = 0.0;
    for (unsigned int i = threadIdx.x; i < B; i += blockDim.x) a += (double)adv[i];
    s1[threadIdx.x] = a;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) s1[threadIdx.x] += s1[threadIdx.x + s];
        __syncthreads();
    }
    double mean = s1[0] / (double)B;
    double q = 0.0;
    for (unsigned int i = threadIdx.x; i < B; i += blockDim.x) {
        double c = (double)adv[i] - mean;
        q += c * c;
    }
    s2[threadIdx.x] = q;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) s2[threadIdx.x] += s2[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        stats[0] = (float)mean;
        stats[1] = (float)sqrt(s2[0] / (double)(B - 1));
    }
}

#define PPO_MAX_A 8

// PPO clipped-surrogate loss per row (one thread per row; MODELS.md / fx_models::ppo_loss):
// rows [B, 6] = (loss, l_clip, l_v, entropy, approx_kl, clip_frac) per row, whose column
// means are the minibatch values; d_logits [B, A] and d_value [B] are the gradients of the
// mean loss. Member m = blockIdx.y: every buffer at member m's block; its clip, vf_coef and
// ent_coef are coefs_m[3m..3m+3] when coefs_m is not 0.
extern "C" __global__ void fx_ppo_loss(const float* __restrict__ logits, const float* __restrict__ value,
                                       const unsigned int* __restrict__ actions, const float* __restrict__ logp_old,
                                       const float* __restrict__ adv, const float* __restrict__ ret,
                                       const float* __restrict__ adv_stats, unsigned int B, unsigned int A,
                                       float clip, float vf_coef, float ent_coef, float adv_eps,
                                       float* __restrict__ rows, float* __restrict__ d_logits,
                                       float* __restrict__ d_value, const float* __restrict__ coefs_m) {
    size_t m = blockIdx.y;
    logits += m * B * A;
    value += m * B;
    actions += m * B;
    logp_old += m * B;
    adv += m * B;
    ret += m * B;
    adv_stats += 2 * m;
    rows += m * B * 6;
    d_logits += m * B * A;
    d_value += m * B;
    if (coefs_m) {
        clip = coefs_m[3 * m];
        vf_coef = coefs_m[3 * m + 1];
        ent_coef = coefs_m[3 * m + 2];
    }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B) return;
    const float* z = logits + (size_t)i * A;
    float mx = z[0];
    for (unsigned int a = 1; a < A; ++a) mx = fmaxf(mx, z[a]);
    float se = 0.0f;
    for (unsigned int a = 0; a < A; ++a) se += expf(z[a] - mx);
    float lse = mx + logf(se);
    float lp[PPO_MAX_A], p[PPO_MAX_A];
    float h = 0.0f;
    for (unsigned int a = 0; a < A; ++a) {
        lp[a] = z[a] - lse;
        p[a] = expf(lp[a]);
        h -= p[a] * lp[a];
    }
    unsigned int act = actions[i];
    if (act >= A) act = A - 1;
    float adv_n = (adv[i] - adv_stats[0]) / (adv_stats[1] + adv_eps);
    float logratio = lp[act] - logp_old[i];
    float ratio = expf(logratio);
    float lo = 1.0f - clip, hi = 1.0f + clip;
    bool inside = ratio >= lo && ratio <= hi;
    float pg1 = ratio * adv_n;
    float pg2 = fminf(fmaxf(ratio, lo), hi) * adv_n;
    bool take1 = pg1 <= pg2;
    float surr = take1 ? pg1 : pg2;
    float dv = value[i] - ret[i];
    float lv = 0.5f * dv * dv;
    float* r = rows + (size_t)i * 6;
    r[0] = -surr + vf_coef * lv - ent_coef * h;
    r[1] = -surr;
    r[2] = lv;
    r[3] = h;
    r[4] = (ratio - 1.0f) - logratio;
    r[5] = fabsf(ratio - 1.0f) > clip ? 1.0f : 0.0f;
    float inv_b = 1.0f / (float)B;
    float dlogp = (take1 || inside) ? -adv_n * ratio * inv_b : 0.0f;
    for (unsigned int a = 0; a < A; ++a) {
        float g = dlogp * ((a == act ? 1.0f : 0.0f) - p[a]) + ent_coef * inv_b * p[a] * (lp[a] + h);
        d_logits[(size_t)i * A + a] = g;
    }
    d_value[i] = vf_coef * dv * inv_b;
}
