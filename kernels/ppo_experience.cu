// PPO experience: sample every account's action from its logits (softmax in f64, stream-3
// draw), step, and write (s, a, log pi(a|s), value, r, done) into row `row` of the [T, E]
// rollout storage. One thread per account, grid-stride loop.
#include "fx_env.cuh"

extern "C" __global__ void fx_ppo_experience(
    const float* __restrict__ market, const double* __restrict__ close, fx_u32 T, fx_u32 L, double cost,
    fx_u64 seed, fx_u64 env_offset, fx_u32 E, fx_u32* st_t, int* st_pos, double* st_entry, fx_u32* st_sip,
    fx_u32* st_ep, fx_u64* st_counter, const float* __restrict__ logits, const float* __restrict__ values,
    fx_u32 row, float* __restrict__ ro_s, fx_u32* __restrict__ ro_a, float* __restrict__ ro_logp,
    float* __restrict__ ro_v, float* __restrict__ ro_r, float* __restrict__ ro_d, float* __restrict__ next_obs,
    float* __restrict__ obs, int* err) {
    FxEnv env;
    env.market = market;
    env.close = close;
    env.T = T;
    env.L = L;
    env.cost = cost;
    env.seed = seed;
    env.env_offset = env_offset;
    env.t = st_t;
    env.pos = st_pos;
    env.entry = st_entry;
    env.sip = st_sip;
    env.ep = st_ep;
    env.counter = st_counter;
    for (fx_u32 e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
        size_t k = (size_t)row * E + e;
        double u = fx_draw(seed, FX_STREAM_POLICY, env_offset + e, st_counter[e]);
        double logp;
        fx_u32 a = fx_sample_logits(logits + (size_t)e * FX_N_ACTIONS, u, &logp);
        fx_observe(env, e, ro_s + k * FX_OBS_DIM);
        double r;
        bool d;
        fx_step(env, e, a, next_obs ? next_obs + (size_t)e * FX_OBS_DIM : 0, &r, &d, err);
        ro_a[k] = a;
        ro_logp[k] = (float)logp;
        ro_v[k] = values[e];
        ro_r[k] = (float)r;
        ro_d[k] = d ? 1.0f : 0.0f;
        fx_observe(env, e, obs + (size_t)e * FX_OBS_DIM);
    }
}
