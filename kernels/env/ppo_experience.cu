// PPO experience: sample every account's action from its logits (softmax in f64, stream-3
// draw), step, and write (s, a, log pi(a|s), value, r, done) into row `row` of the [T, E]
// rollout storage. One thread per account in a warp-uniform grid-stride loop; state rows
// are written warp-cooperatively.
#include "fx_env.cuh"

extern "C" __global__ void fx_ppo_experience(
    const float* __restrict__ market, const double* __restrict__ close, fx_u32 T, fx_u32 L,
    const fx_u32* __restrict__ seg, fx_u32 n_seg, const float* __restrict__ norm, float clip, double cost,
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
    env.seg = seg;
    env.n_seg = n_seg;
    env.norm = norm;
    env.clip = clip;
    env.cost = cost;
    env.seed = seed;
    env.env_offset = env_offset;
    env.t = st_t;
    env.pos = st_pos;
    env.entry = st_entry;
    env.sip = st_sip;
    env.ep = st_ep;
    env.counter = st_counter;
    FX_WARP_LOOP(e, valid, E) {
        const size_t k = (size_t)row * E + e;
        FxRow s = {0u, 0.0f, 0.0f, 0.0f}, next = s, cur = s;
        if (valid) {
            double u = fx_draw(seed, FX_STREAM_POLICY, env_offset + e, st_counter[e]);
            double logp;
            fx_u32 a = fx_sample_logits(logits + (size_t)e * FX_N_ACTIONS, u, &logp);
            s = fx_current(env, e);
            double r;
            bool d;
            fx_step(env, e, a, &next, &cur, &r, &d, err);
            ro_a[k] = a;
            ro_logp[k] = (float)logp;
            ro_v[k] = values[e];
            ro_r[k] = (float)r;
            ro_d[k] = d ? 1.0f : 0.0f;
        }
        fx_warp_write_rows(ro_s + k * FX_OBS_DIM, valid, s, env);
        if (next_obs) fx_warp_write_rows(next_obs + (size_t)e * FX_OBS_DIM, valid, next, env);
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, env);
    }
}
