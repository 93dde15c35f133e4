// Shared device code of the trading-environment kernels (MODELS.md "Trading environment").
// Every function mirrors the CPU reference in crates/fx-kernels/src (env.rs, select.rs;
// the draws are common/fx_rng.cuh's) operation for operation. Floating-point arithmetic
// that must agree with the CPU uses the explicit round-to-nearest intrinsics (__dmul_rn,
// __dadd_rn, ...): the compiler never contracts those into FMAs, whatever -fmad setting the
// PTX build uses.
#pragma once

#include "fx_rng.cuh"

#define FX_N_MARKET 51
#define FX_OBS_DIM 56
#define FX_N_ACTIONS 3

#define FX_STREAM_RESET 0ULL
#define FX_STREAM_EXPLORE 1ULL
#define FX_STREAM_RANDOM_ACTION 2ULL
#define FX_STREAM_POLICY 3ULL
#define FX_STREAM_INSTRUMENT 4ULL

// Error flag bits (GpuTradingEnv reads them on demand).
#define FX_ERR_ACTION 1

// fx_kernels::LinearSchedule::value: start + (end - start) * (step / steps) before `steps`,
// `end` from then on (the DQN ε ramp of a captured collection step).
__device__ __forceinline__ double fx_linear_ramp(double start, double end, fx_u64 steps, fx_u64 step) {
    if (step >= steps) return end;
    double frac = __ddiv_rn((double)step, (double)steps);
    return __dadd_rn(start, __dmul_rn(__dsub_rn(end, start), frac));
}

// Start index of a reset: floor(u * (T - L)).
__device__ __forceinline__ fx_u32 fx_reset_start(fx_u64 seed, fx_u64 env, fx_u64 counter, fx_u32 T, fx_u32 L) {
    double u = fx_draw(seed, FX_STREAM_RESET, env, counter);
    return (fx_u32)floor(__dmul_rn(u, (double)(T - L)));
}

// The portfolio part of an observation row: p, p*ln(close[t]/entry) (0 when flat),
// sip/L; the row is [market[t] (51), p, upnl, tip, 0, 0].
struct FxRow {
    fx_u32 t;
    float p, upnl, tip;
};

__device__ __forceinline__ FxRow fx_row(const double* __restrict__ close, fx_u32 L, fx_u32 t, int pos, double entry,
                                        fx_u32 sip) {
    FxRow r;
    r.t = t;
    double upnl = 0.0;
    if (pos != 0) upnl = __dmul_rn((double)pos, log(__ddiv_rn(close[t], entry)));
    r.p = (float)pos;
    r.upnl = (float)upnl;
    r.tip = (float)__ddiv_rn((double)sip, (double)L);
    return r;
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
    // Segments (a panel's instruments): seg[2k]..seg[2k+1] for k < n_seg, sorted, disjoint.
    const fx_u32* __restrict__ seg;
    fx_u32 n_seg;
    // Per-segment normalisers [n_seg, 2, 51] (means, then stds) applied as rows are
    // written, clipped to +-clip; null: the rows are written as they are.
    const float* __restrict__ norm;
    float clip;
    double cost;
    fx_u64 seed, env_offset;
    fx_u32* t;
    int* pos;
    double* entry;
    fx_u32* sip;
    fx_u32* ep;
    fx_u64* counter;
};

// One member's row of a population's device table (PopMemberArgs in
// crates/fx-kernels/src/cuda/pop_collect.rs, field for field: 200 bytes, no padding): its
// env's series, parameters and state, its replay ring and its ε ramp.
struct FxPopMember {
    const float* market;
    const double* close;
    const fx_u32* seg;
    const float* norm;
    fx_u32* t;
    int* pos;
    double* entry;
    fx_u32* sip;
    fx_u32* ep;
    fx_u64* counter;
    int* err;
    float* rb_s;
    fx_u32* rb_a;
    float* rb_r;
    float* rb_s2;
    float* rb_d;
    fx_u64 seed, env_offset;
    double cost, eps_start, eps_end;
    fx_u64 eps_steps;
    // The member's replay-sampling seed: its trainer's, not its env's (the solo trainer
    // samples with DqnConfig::seed, the env draws with EnvConfig::seed).
    fx_u64 sample_seed;
    // The member's own clocks (a trial that took a freed slot mid-run): the env step it began
    // at (its eps ramp runs from there), the ring slot of its first transition and the draws
    // taken before its first (its draw keys count from there). All 0 for a member from the
    // start.
    fx_u64 clock0, ring_start, key0;
    fx_u32 T, L, n_seg;
    float clip;
};
static_assert(sizeof(FxPopMember) == 224, "FxPopMember must match fx-kernels' PopMemberArgs");

__device__ __forceinline__ FxEnv fx_pop_env(const FxPopMember& m) {
    FxEnv env;
    env.market = m.market;
    env.close = m.close;
    env.T = m.T;
    env.L = m.L;
    env.seg = m.seg;
    env.n_seg = m.n_seg;
    env.norm = m.norm;
    env.clip = m.clip;
    env.cost = m.cost;
    env.seed = m.seed;
    env.env_offset = m.env_offset;
    env.t = m.t;
    env.pos = m.pos;
    env.entry = m.entry;
    env.sip = m.sip;
    env.ep = m.ep;
    env.counter = m.counter;
    return env;
}

// Start index of a reset in env's series (EnvData's reset_start_in): one segment is the
// reference's reset; several draw the segment first, floor(u_k * S), then the start in it.
__device__ __forceinline__ fx_u32 fx_reset_start_in(const FxEnv& env, fx_u64 env_id, fx_u64 counter) {
    // One segment: no instrument draw, the reset inside it (a view's segment need not
    // cover the rows).
    if (env.n_seg <= 1u) return env.seg[0] + fx_reset_start(env.seed, env_id, counter, env.seg[1] - env.seg[0], env.L);
    double uk = fx_draw(env.seed, FX_STREAM_INSTRUMENT, env_id, counter);
    fx_u32 k = (fx_u32)floor(__dmul_rn(uk, (double)env.n_seg));
    if (k >= env.n_seg) k = env.n_seg - 1u;
    fx_u32 s0 = env.seg[2u * k];
    return s0 + fx_reset_start(env.seed, env_id, counter, env.seg[2u * k + 1u] - s0, env.L);
}

// The observation values of account e's current state.
__device__ __forceinline__ FxRow fx_current(const FxEnv& env, fx_u32 e) {
    return fx_row(env.close, env.L, env.t[e], env.pos[e], env.entry[e], env.sip[e]);
}

// The segment holding row t (EnvData::segment_of): the last whose start is <= t.
__device__ __forceinline__ fx_u32 fx_segment_of(const FxEnv& env, fx_u32 t) {
    fx_u32 lo = 0u, hi = env.n_seg;  // the answer lies in [lo, hi)
    while (hi - lo > 1u) {
        const fx_u32 mid = (lo + hi) >> 1;
        if (env.seg[2u * mid] <= t) lo = mid;
        else hi = mid;
    }
    return lo;
}

// One observed market value: raw, or ((x - mean) / std) clipped to +-clip in F32 with
// round-to-nearest operations (fx_data::Normalizer::apply_in_place; f32::clamp equals
// fminf/fmaxf on the finite values EnvData admits).
__device__ __forceinline__ float fx_observed(float x, const float* nrm, unsigned c, float clip) {
    if (!nrm) return x;
    const float v = __fdiv_rn(__fsub_rn(x, __ldg(nrm + c)), __ldg(nrm + FX_N_MARKET + c));
    return fminf(fmaxf(v, -clip), clip);
}

// Writes the observation rows of the 32 accounts of a warp cooperatively: lane i owns row
// `dst` (any address; rows of consecutive lanes are usually consecutive) and its values
// `row`; rows with valid == false are skipped. The warp walks the 32 rows together, each
// lane storing columns `lane` and `lane + 32` of the current row, so every store and every
// market-row load is coalesced (instead of each lane striding through its own 224-byte
// row), and the unrolled row loop keeps many loads in flight. A view's rows are normalised
// on the way (each lane finds its own row's segment first). Must be called by all 32 lanes
// of the warp (warp-uniform control flow).
__device__ __forceinline__ void fx_warp_write_rows(float* dst, bool valid, FxRow row, const FxEnv& env) {
    const unsigned full = 0xffffffffu;
    const unsigned lane = threadIdx.x & 31u;
    const unsigned vmask = __ballot_sync(full, valid);
    if (vmask == 0u) return;
    const float* __restrict__ market = env.market;
    const float clip = env.clip;
    const unsigned long long my_dst = (unsigned long long)dst;
    const unsigned long long my_norm =
        (env.norm && valid) ? (unsigned long long)(env.norm + (size_t)fx_segment_of(env, row.t) * 2u * FX_N_MARKET)
                            : 0ull;
    const unsigned c2 = lane + 32u;
#pragma unroll 8
    for (unsigned r = 0; r < 32u; ++r) {
        const unsigned long long d = __shfl_sync(full, my_dst, r);
        const unsigned long long nq = __shfl_sync(full, my_norm, r);
        const fx_u32 t = __shfl_sync(full, row.t, r);
        const float p = __shfl_sync(full, row.p, r);
        const float u = __shfl_sync(full, row.upnl, r);
        const float q = __shfl_sync(full, row.tip, r);
        if ((vmask >> r) & 1u) {
            const float* m = market + (size_t)t * FX_N_MARKET;
            const float* nrm = (const float*)nq;
            float* o = (float*)d;
            o[lane] = fx_observed(__ldg(m + lane), nrm, lane, clip);  // columns 0..31: market features
            if (c2 < FX_OBS_DIM) {
                float v;
                if (c2 < FX_N_MARKET) v = fx_observed(__ldg(m + c2), nrm, c2, clip);
                else if (c2 == FX_N_MARKET) v = p;
                else if (c2 == FX_N_MARKET + 1) v = u;
                else if (c2 == FX_N_MARKET + 2) v = q;
                else v = 0.0f;
                o[c2] = v;
            }
        }
    }
}

// Steps account e with action a (invalid actions are treated as flat and flagged): returns
// the pre-reset next state's row values in *next, the post-reset ones in *cur (equal to
// *next unless the episode ended: the reset row is flat, so it needs no log), the reward
// and done, and auto-resets.
__device__ __forceinline__ void fx_step(const FxEnv& env, fx_u32 e, fx_u32 a, FxRow* next, FxRow* cur,
                                        double* reward, bool* done, int* err) {
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
    *next = fx_row(env.close, env.L, t, p_new, entry, sip);
    *done = ep >= env.L;
    if (*done) {
        t = fx_reset_start_in(env, env.env_offset + e, counter);
        p_new = 0;
        entry = env.close[t];
        sip = 0;
        ep = 0;
        cur->t = t;
        cur->p = 0.0f;
        cur->upnl = 0.0f;
        cur->tip = 0.0f;
    } else {
        *cur = *next;
    }
    env.t[e] = t;
    env.pos[e] = p_new;
    env.entry[e] = entry;
    env.sip[e] = sip;
    env.ep[e] = ep;
    env.counter[e] = counter;
}

// Warp-uniform grid-stride loop over accounts: every lane of a warp runs the same number of
// iterations (fx_warp_write_rows needs all 32 lanes); on the last one `e` may be >= n and
// `valid` is false for such lanes. Needs blockDim.x to be a multiple of 32 (the host's
// LaunchPlan guarantees it).
#define FX_WARP_LOOP(e, valid, n)                                                                  \
    for (fx_u64 fx_base = (fx_u64)((blockIdx.x * blockDim.x + threadIdx.x) & ~31u); fx_base < (n);  \
         fx_base += (fx_u64)gridDim.x * blockDim.x)                                                \
        if (const fx_u32 e = (fx_u32)(fx_base + (threadIdx.x & 31u)); true)                        \
            if (const bool valid = e < (n); true)
