// Trading environment kernels: observation, plain step, action selection, and the fused
// DQN experience step (step E accounts and write (s, a, r, s', done) into the replay
// ring). One thread per account in warp-uniform grid-stride loops (the host sizes the grid
// from the SM count and the occupancy of the chosen block size); observation rows are
// written warp-cooperatively (fx_warp_write_rows) so the stores coalesce.
#include "fx_env.cuh"

#define FX_ENV_ARGS                                                                               \
    const float *__restrict__ market, const double *__restrict__ close, fx_u32 T, fx_u32 L,        \
        const fx_u32 *__restrict__ seg, fx_u32 n_seg, double cost, fx_u64 seed, fx_u64 env_offset, \
        fx_u32 E, fx_u32 *st_t, int *st_pos, double *st_entry, fx_u32 *st_sip, fx_u32 *st_ep,       \
        fx_u64 *st_counter
#define FX_ENV_MAKE                                                                              \
    FxEnv env;                                                                                   \
    env.market = market;                                                                         \
    env.close = close;                                                                           \
    env.T = T;                                                                                   \
    env.L = L;                                                                                   \
    env.seg = seg;                                                                               \
    env.n_seg = n_seg;                                                                           \
    env.cost = cost;                                                                             \
    env.seed = seed;                                                                             \
    env.env_offset = env_offset;                                                                 \
    env.t = st_t;                                                                                \
    env.pos = st_pos;                                                                            \
    env.entry = st_entry;                                                                        \
    env.sip = st_sip;                                                                            \
    env.ep = st_ep;                                                                              \
    env.counter = st_counter;

// obs[e] = observation of account e's current state.
extern "C" __global__ void fx_env_observe(FX_ENV_ARGS, float* __restrict__ obs) {
    FX_ENV_MAKE
    FX_WARP_LOOP(e, valid, E) {
        FxRow cur = {0u, 0.0f, 0.0f, 0.0f};
        if (valid) cur = fx_current(env, e);
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, market);
    }
}

// One step of every account. next_obs may be null.
extern "C" __global__ void fx_env_step(FX_ENV_ARGS, const fx_u32* __restrict__ actions,
                                       float* __restrict__ next_obs, float* __restrict__ reward,
                                       float* __restrict__ done, float* __restrict__ obs, int* err) {
    FX_ENV_MAKE
    FX_WARP_LOOP(e, valid, E) {
        FxRow next = {0u, 0.0f, 0.0f, 0.0f}, cur = {0u, 0.0f, 0.0f, 0.0f};
        if (valid) {
            double r;
            bool d;
            fx_step(env, e, actions[e], &next, &cur, &r, &d, err);
            reward[e] = (float)r;
            done[e] = d ? 1.0f : 0.0f;
        }
        if (next_obs) fx_warp_write_rows(next_obs + (size_t)e * FX_OBS_DIM, valid, next, market);
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, market);
    }
}

// Epsilon-greedy actions from Q-values [E, 3] with the accounts' current counters.
extern "C" __global__ void fx_select_epsilon_greedy(const float* __restrict__ q, double eps, fx_u64 seed,
                                                    fx_u64 env_offset, fx_u32 E,
                                                    const fx_u64* __restrict__ counter,
                                                    fx_u32* __restrict__ actions) {
    for (fx_u64 e = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; e < E; e += (fx_u64)gridDim.x * blockDim.x) {
        actions[e] = fx_epsilon_greedy(q + e * FX_N_ACTIONS, eps, seed, env_offset + e, counter[e]);
    }
}

// Policy sampling from probabilities [E, 3] (stream 3) with the accounts' current counters.
extern "C" __global__ void fx_select_from_probs(const float* __restrict__ probs, fx_u64 seed, fx_u64 env_offset,
                                                fx_u32 E, const fx_u64* __restrict__ counter,
                                                fx_u32* __restrict__ actions) {
    for (fx_u64 e = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; e < E; e += (fx_u64)gridDim.x * blockDim.x) {
        double u = fx_draw(seed, FX_STREAM_POLICY, env_offset + e, counter[e]);
        actions[e] = fx_categorical(probs + e * FX_N_ACTIONS, u);
    }
}

// DQN experience: account e takes actions[e] (or, when q is not null, the epsilon-greedy
// action from q[e]), and (s, a, r, s', done) goes to replay slot (ring_pos + e) % capacity
// (the host guarantees E <= capacity, so slots are distinct). actions_out, next_obs,
// reward_out and done_out may be null; obs (the post-reset states) is always written.
// With `loop` (kernels/env/replay.cu's counters) not null, ring_pos is loop[1] and eps the ramp
// (eps_start, eps_end, eps_steps) at step loop[0]: a captured step reads both from the device.
extern "C" __global__ void fx_dqn_experience(FX_ENV_ARGS, const fx_u32* __restrict__ actions,
                                             const float* __restrict__ q, double eps,
                                             fx_u32* __restrict__ actions_out, float* __restrict__ rb_s,
                                             fx_u32* __restrict__ rb_a, float* __restrict__ rb_r,
                                             float* __restrict__ rb_s2, float* __restrict__ rb_d,
                                             fx_u64 capacity, fx_u64 ring_pos, float* __restrict__ next_obs,
                                             float* __restrict__ reward_out, float* __restrict__ done_out,
                                             float* __restrict__ obs, int* err,
                                             const fx_u64* __restrict__ loop, double eps_start,
                                             double eps_end, fx_u64 eps_steps) {
    FX_ENV_MAKE
    if (loop) {
        eps = fx_linear_ramp(eps_start, eps_end, eps_steps, loop[0]);
        ring_pos = loop[1];
    }
    FX_WARP_LOOP(e, valid, E) {
        FxRow s = {0u, 0.0f, 0.0f, 0.0f}, next = s, cur = s;
        fx_u64 slot = 0;
        if (valid) {
            fx_u32 a;
            if (q) {
                a = fx_epsilon_greedy(q + (size_t)e * FX_N_ACTIONS, eps, seed, env_offset + e, st_counter[e]);
            } else {
                a = actions[e];
            }
            if (actions_out) actions_out[e] = a;
            slot = (ring_pos + e) % capacity;
            s = fx_current(env, e);
            double r;
            bool d;
            fx_step(env, e, a, &next, &cur, &r, &d, err);
            rb_a[slot] = a < FX_N_ACTIONS ? a : 1;
            rb_r[slot] = (float)r;
            rb_d[slot] = d ? 1.0f : 0.0f;
            if (reward_out) reward_out[e] = (float)r;
            if (done_out) done_out[e] = d ? 1.0f : 0.0f;
        }
        fx_warp_write_rows(rb_s + slot * FX_OBS_DIM, valid, s, market);
        fx_warp_write_rows(rb_s2 + slot * FX_OBS_DIM, valid, next, market);
        if (next_obs) fx_warp_write_rows(next_obs + (size_t)e * FX_OBS_DIM, valid, next, market);
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, market);
    }
}
