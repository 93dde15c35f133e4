// Trading environment kernels: observation, plain step, action selection, and the fused
// DQN experience step (step E accounts and write (s, a, r, s', done) into the replay
// ring). One thread per account in warp-uniform grid-stride loops (the host sizes the grid
// from the SM count and the occupancy of the chosen block size); observation rows are
// written warp-cooperatively (fx_warp_write_rows) so the stores coalesce.
#include "fx_env.cuh"

#define FX_ENV_ARGS                                                                               \
    const float *__restrict__ market, const double *__restrict__ close, fx_u32 T, fx_u32 L,        \
        const fx_u32 *__restrict__ seg, fx_u32 n_seg, const float *__restrict__ norm, float clip,   \
        double cost, fx_u64 seed, fx_u64 env_offset,                                                \
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
    env.norm = norm;                                                                             \
    env.clip = clip;                                                                             \
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
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, env);
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
        if (next_obs) fx_warp_write_rows(next_obs + (size_t)e * FX_OBS_DIM, valid, next, env);
        fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, env);
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

// One account's DQN experience step (fx_dqn_experience's body, shared with the population
// kernel): account e takes actions[e] (or, when q is not null, the epsilon-greedy action from
// q[e]), and (s, a, r, s', done) goes to replay slot (ring_pos + e) % capacity. Called by all
// 32 lanes of a warp (the row writes are warp-cooperative); lanes with valid == false only
// take part in the writes.
struct FxRing {
    float* s;
    fx_u32* a;
    float* r;
    float* s2;
    float* d;
    fx_u64 capacity;
};

__device__ __forceinline__ void fx_dqn_experience_account(const FxEnv& env, fx_u32 e, bool valid,
                                                          const fx_u32* __restrict__ actions,
                                                          const float* __restrict__ q, double eps,
                                                          fx_u32* __restrict__ actions_out, FxRing rb,
                                                          fx_u64 ring_pos, float* __restrict__ next_obs,
                                                          float* __restrict__ reward_out,
                                                          float* __restrict__ done_out, float* __restrict__ obs,
                                                          int* err) {
    FxRow s = {0u, 0.0f, 0.0f, 0.0f}, next = s, cur = s;
    fx_u64 slot = 0;
    if (valid) {
        fx_u32 a;
        if (q) {
            a = fx_epsilon_greedy(q + (size_t)e * FX_N_ACTIONS, eps, env.seed, env.env_offset + e, env.counter[e]);
        } else {
            a = actions[e];
        }
        if (actions_out) actions_out[e] = a;
        slot = (ring_pos + e) % rb.capacity;
        s = fx_current(env, e);
        double r;
        bool d;
        fx_step(env, e, a, &next, &cur, &r, &d, err);
        rb.a[slot] = a < FX_N_ACTIONS ? a : 1;
        rb.r[slot] = (float)r;
        rb.d[slot] = d ? 1.0f : 0.0f;
        if (reward_out) reward_out[e] = (float)r;
        if (done_out) done_out[e] = d ? 1.0f : 0.0f;
    }
    fx_warp_write_rows(rb.s + slot * FX_OBS_DIM, valid, s, env);
    fx_warp_write_rows(rb.s2 + slot * FX_OBS_DIM, valid, next, env);
    if (next_obs) fx_warp_write_rows(next_obs + (size_t)e * FX_OBS_DIM, valid, next, env);
    fx_warp_write_rows(obs + (size_t)e * FX_OBS_DIM, valid, cur, env);
}

// DQN experience: fx_dqn_experience_account for every account (the host guarantees
// E <= capacity, so slots are distinct). actions_out, next_obs, reward_out and done_out may
// be null; obs (the post-reset states) is always written.
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
    const FxRing rb = {rb_s, rb_a, rb_r, rb_s2, rb_d, capacity};
    FX_WARP_LOOP(e, valid, E) {
        fx_dqn_experience_account(env, e, valid, actions, q, eps, actions_out, rb, ring_pos, next_obs, reward_out,
                                  done_out, obs, err);
    }
}

// Population kernels: member k = blockIdx.y of the table `members` (FxPopMember), each with
// E accounts; member k's rows of obs, q, reward and done start at k * E. Per account they run
// the solo kernels' code, so member k's results are those of fx_env_observe and
// fx_dqn_experience on its own env and replay.

// obs[k, e] = observation of member k's account e.
extern "C" __global__ void fx_pop_observe(const FxPopMember* __restrict__ members, fx_u32 E,
                                          float* __restrict__ obs) {
    const FxEnv env = fx_pop_env(members[blockIdx.y]);
    float* o = obs + (size_t)blockIdx.y * E * FX_OBS_DIM;
    FX_WARP_LOOP(e, valid, E) {
        FxRow cur = {0u, 0.0f, 0.0f, 0.0f};
        if (valid) cur = fx_current(env, e);
        fx_warp_write_rows(o + (size_t)e * FX_OBS_DIM, valid, cur, env);
    }
}

// One epsilon-greedy DQN experience step of every member from q [N, E, 3]: member k's eps is
// its ramp at its own step env_step - clock0, its transitions go to its own ring at ring_pos (every member's ring
// is at the same position and has the same capacity, E <= capacity). obs [N, E, 56] gets the
// post-reset states; reward_out and done_out ([N, E]) may be null.
// With `loop` (kernels/env/replay.cu's counters, shared by the members: their rings move in
// step) not null, env_step is loop[0] and ring_pos loop[1], so a captured iteration reads them
// from the device.
extern "C" __global__ void fx_pop_dqn_experience(const FxPopMember* __restrict__ members, fx_u32 E,
                                                 fx_u64 capacity, const float* __restrict__ q,
                                                 fx_u64 env_step, fx_u64 ring_pos, float* __restrict__ obs,
                                                 float* __restrict__ reward_out, float* __restrict__ done_out,
                                                 const fx_u64* __restrict__ loop) {
    if (loop) {
        env_step = loop[0];
        ring_pos = loop[1];
    }
    const FxPopMember& m = members[blockIdx.y];
    const FxEnv env = fx_pop_env(m);
    const double eps = fx_linear_ramp(m.eps_start, m.eps_end, m.eps_steps, env_step - m.clock0);
    const FxRing rb = {m.rb_s, m.rb_a, m.rb_r, m.rb_s2, m.rb_d, capacity};
    const size_t off = (size_t)blockIdx.y * E;
    float* r_out = reward_out ? reward_out + off : nullptr;
    float* d_out = done_out ? done_out + off : nullptr;
    FX_WARP_LOOP(e, valid, E) {
        fx_dqn_experience_account(env, e, valid, nullptr, q + off * FX_N_ACTIONS, eps, nullptr, rb, ring_pos, nullptr,
                                  r_out, d_out, obs + off * FX_OBS_DIM, m.err);
    }
}
