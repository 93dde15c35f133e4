// Shared device code of the trading-environment kernels (MODELS.md "Trading environment").
// Every function mirrors the CPU reference in crates/fx-kernels/src (env.rs, rng.rs,
// select.rs) operation for operation. Floating-point arithmetic that must agree with the
// CPU uses the explicit round-to-nearest intrinsics (__dmul_rn, __dadd_rn, ...): the
// compiler never contracts those into FMAs, whatever -fmad setting the PTX build uses.
#pragma once

typedef unsigned long long fx_u64;
typedef unsigned int fx_u32;

#define FX_N_MARKET 51
#define FX_OBS_DIM 56
#define FX_N_ACTIONS 3

#define FX_STREAM_RESET 0ULL
#define FX_STREAM_EXPLORE 1ULL
#define FX_STREAM_RANDOM_ACTION 2ULL
#define FX_STREAM_POLICY 3ULL

// Error flag bits (GpuTradingEnv reads them on demand).
#define FX_ERR_ACTION 1

// SplitMix64 finaliser (wrapping u64 arithmetic).
__device__ __forceinline__ fx_u64 fx_mix(fx_u64 z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// u = (mix(mix(mix(seed ^ stream) ^ env) ^ step) >> 11) * 2^-53, exact in double.
__device__ __forceinline__ double fx_draw(fx_u64 seed, fx_u64 stream, fx_u64 env, fx_u64 step) {
    fx_u64 b = fx_mix(fx_mix(fx_mix(seed ^ stream) ^ env) ^ step);
    return __dmul_rn((double)(b >> 11), 1.1102230246251565e-16);
}

// Start index of a reset: floor(u * (T - L)).
__device__ __forceinline__ fx_u32 fx_reset_start(fx_u64 seed, fx_u64 env, fx_u64 counter, fx_u32 T, fx_u32 L) {
    double u = fx_draw(seed, FX_STREAM_RESET, env, counter);
    return (fx_u32)floor(__dmul_rn(u, (double)(T - L)));
}

// One observation row: [market[t] (51), p, p*ln(close[t]/entry) (0 when flat), sip/L, 0, 0].
__device__ __forceinline__ void fx_write_obs(const float* __restrict__ market, const double* __restrict__ close,
                                             fx_u32 L, fx_u32 t, int pos, double entry, fx_u32 sip,
                                             float* __restrict__ out) {
    const float* row = market + (size_t)t * FX_N_MARKET;
#pragma unroll
    for (int j = 0; j < FX_N_MARKET; ++j) out[j] = __ldg(row + j);
    double upnl = 0.0;
    if (pos != 0) upnl = __dmul_rn((double)pos, log(__ddiv_rn(close[t], entry)));
    out[FX_N_MARKET] = (float)pos;
    out[FX_N_MARKET + 1] = (float)upnl;
    out[FX_N_MARKET + 2] = (float)__ddiv_rn((double)sip, (double)L);
    out[FX_N_MARKET + 3] = 0.0f;
    out[FX_N_MARKET + 4] = 0.0f;
}

// Argmax of a row of Q-values, ties to the lowest index.
__device__ __forceinline__ fx_u32 fx_argmax(const float* q) {
    fx_u32 best = 0;
#pragma unroll
    for (fx_u32 j = 1; j < FX_N_ACTIONS; ++j)
        if (q[j] > q[best]) best = j;
    return best;
}

// Epsilon-greedy: explore if u1 < eps (stream 1), random action floor(3 u2) (stream 2).
__device__ __forceinline__ fx_u32 fx_epsilon_greedy(const float* q, double eps, fx_u64 seed, fx_u64 env,
                                                    fx_u64 counter) {
    double u1 = fx_draw(seed, FX_STREAM_EXPLORE, env, counter);
    if (u1 < eps) {
        double u2 = fx_draw(seed, FX_STREAM_RANDOM_ACTION, env, counter);
        fx_u32 a = (fx_u32)floor(__dmul_rn(u2, (double)FX_N_ACTIONS));
        return a < FX_N_ACTIONS - 1 ? a : FX_N_ACTIONS - 1;
    }
    return fx_argmax(q);
}

// Categorical from probabilities: count of f64 cdf <= u, capped at the last action.
__device__ __forceinline__ fx_u32 fx_categorical(const float* p, double u) {
    double cdf = 0.0;
    fx_u32 count = 0;
#pragma unroll
    for (int j = 0; j < FX_N_ACTIONS; ++j) {
        cdf = __dadd_rn(cdf, (double)p[j]);
        if (cdf <= u) ++count;
    }
    return count < FX_N_ACTIONS - 1 ? count : FX_N_ACTIONS - 1;
}

// Categorical from logits (softmax in f64, max-shifted), returning the log-probability too.
__device__ __forceinline__ fx_u32 fx_sample_logits(const float* l, double u, double* logp) {
    double m = (double)l[0];
#pragma unroll
    for (int j = 1; j < FX_N_ACTIONS; ++j) m = fmax(m, (double)l[j]);
    double z = 0.0;
#pragma unroll
    for (int j = 0; j < FX_N_ACTIONS; ++j) z = __dadd_rn(z, exp(__dsub_rn((double)l[j], m)));
    double cdf = 0.0;
    fx_u32 count = 0;
#pragma unroll
    for (int j = 0; j < FX_N_ACTIONS; ++j) {
        cdf = __dadd_rn(cdf, __ddiv_rn(exp(__dsub_rn((double)l[j], m)), z));
        if (cdf <= u) ++count;
    }
    fx_u32 a = count < FX_N_ACTIONS - 1 ? count : FX_N_ACTIONS - 1;
    *logp = __dsub_rn(__dsub_rn((double)l[a], m), log(z));
    return a;
}

// The per-account environment state (structure of arrays) and the series.
struct FxEnv {
    const float* __restrict__ market;  // [T, 51]
    const double* __restrict__ close;  // [T]
    fx_u32 T, L;
    double cost;
    fx_u64 seed, env_offset;
    fx_u32* t;
    int* pos;
    double* entry;
    fx_u32* sip;
    fx_u32* ep;
    fx_u64* counter;
};

// Observation of account e's current state.
__device__ __forceinline__ void fx_observe(const FxEnv& env, fx_u32 e, float* out) {
    fx_write_obs(env.market, env.close, env.L, env.t[e], env.pos[e], env.entry[e], env.sip[e], out);
}

// Steps account e with action a (invalid actions are treated as flat and flagged).
// Writes the pre-reset next state to next_obs (if not null), returns reward and done,
// and auto-resets. The post-reset state can then be written with fx_observe.
__device__ __forceinline__ void fx_step(const FxEnv& env, fx_u32 e, fx_u32 a, float* next_obs, double* reward,
                                        bool* done, int* err) {
    if (a >= FX_N_ACTIONS) {
        atomicOr(err, FX_ERR_ACTION);
        a = 1;
    }
    fx_u32 t = env.t[e];
    int p_old = env.pos[e];
    int p_new = (int)a - 1;
    double c_t = env.close[t];
    double c_t1 = env.close[t + 1];
    int dp = p_new - p_old;
    if (dp < 0) dp = -dp;
    *reward = __dsub_rn(__dmul_rn((double)p_new, log(__ddiv_rn(c_t1, c_t))), __dmul_rn(env.cost, (double)dp));
    double entry = env.entry[e];
    fx_u32 sip = env.sip[e];
    if (p_new != p_old) {
        entry = c_t;
        sip = 0;
    } else {
        sip += 1;
    }
    t += 1;
    fx_u32 ep = env.ep[e] + 1;
    fx_u64 counter = env.counter[e] + 1;
    if (next_obs) fx_write_obs(env.market, env.close, env.L, t, p_new, entry, sip, next_obs);
    *done = ep >= env.L;
    if (*done) {
        t = fx_reset_start(env.seed, env.env_offset + e, counter, env.T, env.L);
        p_new = 0;
        entry = env.close[t];
        sip = 0;
        ep = 0;
    }
    env.t[e] = t;
    env.pos[e] = p_new;
    env.entry[e] = entry;
    env.sip[e] = sip;
    env.ep[e] = ep;
    env.counter[e] = counter;
}
