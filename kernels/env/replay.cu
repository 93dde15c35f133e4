// Replay sampling and the DQN collection loop's device counters, so a whole DQN iteration
// (collect, sample, update) can be one CUDA graph whose replays never need the host.
//
// The loop block is six u64 (FX_LOOP_*): the environment step count, the replay ring's
// position and length, the key of the next minibatch draw and the key of this iteration's
// first minibatch. fx_dqn_experience reads the step count (for the ε ramp) and the ring
// position from it; fx_dqn_loop_advance moves it on after the step; fx_replay_sample reads
// the length and key. The Rust side mirrors every field on the host (DqnLoop in
// crates/fx-kernels/src/cuda/dqn_loop.rs), so nothing is ever read back to drive a step.
#include "fx_env.cuh"

#define FX_LOOP_ENV_STEP 0
#define FX_LOOP_POS 1
#define FX_LOOP_LEN 2
#define FX_LOOP_KEY 3
#define FX_LOOP_BASE 4

// Minibatch rows of `B` from `len` stored transitions into s, a, r, s2, d: row i is index
// floor(u * len) (clamped to len - 1) with u = fx_draw(seed, stream, key, i), as
// ReplayBuffer::sample_keyed on the CPU, at slot (start + index) mod capacity (a window of
// the ring, ReplayBuffer::sample_keyed_window). One thread per (row, column) of the [B, 56]
// states (grid-stride over blockIdx.x), so the copies coalesce; column 0 copies the scalars.
__device__ __forceinline__ void fx_replay_gather_window(fx_u64 len, fx_u64 start, fx_u64 capacity, fx_u64 key,
                                                        fx_u64 seed, fx_u64 stream, fx_u32 B,
                                                 const float* __restrict__ rb_s, const fx_u32* __restrict__ rb_a,
                                                 const float* __restrict__ rb_r, const float* __restrict__ rb_s2,
                                                 const float* __restrict__ rb_d, float* __restrict__ s,
                                                 fx_u32* __restrict__ a, float* __restrict__ r,
                                                 float* __restrict__ s2, float* __restrict__ d) {
    const fx_u64 total = (fx_u64)B * FX_OBS_DIM;
    for (fx_u64 k = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (fx_u64)gridDim.x * blockDim.x) {
        fx_u64 i = k / FX_OBS_DIM, c = k % FX_OBS_DIM;
        double u = fx_draw(seed, stream, key, i);
        fx_u64 j = (fx_u64)__dmul_rn(u, (double)len);
        if (j + 1 > len) j = len > 0 ? len - 1 : 0;
        j += start;  // start < capacity and j < len <= capacity
        if (j >= capacity) j -= capacity;
        s[k] = rb_s[j * FX_OBS_DIM + c];
        s2[k] = rb_s2[j * FX_OBS_DIM + c];
        if (c == 0) {
            a[i] = rb_a[j];
            r[i] = rb_r[j];
            d[i] = rb_d[j];
        }
    }
}

// The whole ring (slot j is draw j's).
__device__ __forceinline__ void fx_replay_gather(fx_u64 len, fx_u64 key, fx_u64 seed, fx_u64 stream, fx_u32 B,
                                                 const float* __restrict__ rb_s, const fx_u32* __restrict__ rb_a,
                                                 const float* __restrict__ rb_r, const float* __restrict__ rb_s2,
                                                 const float* __restrict__ rb_d, float* __restrict__ s,
                                                 fx_u32* __restrict__ a, float* __restrict__ r,
                                                 float* __restrict__ s2, float* __restrict__ d) {
    fx_replay_gather_window(len, 0, len > 0 ? len : 1, key, seed, stream, B, rb_s, rb_a, rb_r, rb_s2, rb_d, s, a, r, s2, d);
}

// fx_replay_gather from one ring. With `loop` not null, len = loop[LEN] and
// key = loop[BASE] + key_offset (a captured iteration's j-th minibatch); otherwise the host's
// len and key.
extern "C" __global__ void fx_replay_sample(const fx_u64* __restrict__ loop, fx_u64 len, fx_u64 key,
                                            fx_u64 key_offset, fx_u64 seed, fx_u64 stream, fx_u32 B,
                                            const float* __restrict__ rb_s, const fx_u32* __restrict__ rb_a,
                                            const float* __restrict__ rb_r, const float* __restrict__ rb_s2,
                                            const float* __restrict__ rb_d, float* __restrict__ s,
                                            fx_u32* __restrict__ a, float* __restrict__ r,
                                            float* __restrict__ s2, float* __restrict__ d) {
    if (loop) {
        len = loop[FX_LOOP_LEN];
        key = loop[FX_LOOP_BASE] + key_offset;
    }
    fx_replay_gather(len, key, seed, stream, B, rb_s, rb_a, rb_r, rb_s2, rb_d, s, a, r, s2, d);
}

// One minibatch of B rows per member of a population (member k = blockIdx.y of the table,
// FxPopMember in fx_env.cuh): member k's rows k*B .. (k+1)*B of the outputs are drawn from its
// window of its ring with its seed at its own key `key - key0`, as fx_replay_sample on a ring
// of its own: its transitions are those written since its env step clock0 (E a step, at most
// the ring's `len`), from slot ring_start on. With `loop` not null (the members' shared loop
// block, after fx_dqn_loop_advance), len = loop[LEN], env_step = loop[ENV_STEP] and
// key = loop[BASE] + key_offset (a captured iteration's j-th minibatch).
extern "C" __global__ void fx_pop_replay_sample(const FxPopMember* __restrict__ members, fx_u64 len,
                                                fx_u64 env_step, fx_u64 E, fx_u64 capacity, fx_u64 key,
                                                fx_u64 stream, fx_u32 B, float* __restrict__ s,
                                                fx_u32* __restrict__ a, float* __restrict__ r,
                                                float* __restrict__ s2, float* __restrict__ d,
                                                const fx_u64* __restrict__ loop, fx_u64 key_offset) {
    if (loop) {
        len = loop[FX_LOOP_LEN];
        env_step = loop[FX_LOOP_ENV_STEP];
        key = loop[FX_LOOP_BASE] + key_offset;
    }
    const FxPopMember& m = members[blockIdx.y];
    const size_t off = (size_t)blockIdx.y * B;
    const fx_u64 own = (env_step - m.clock0) * E;
    fx_replay_gather_window(own < len ? own : len, m.ring_start, capacity, key - m.key0, m.sample_seed, stream, B,
                            m.rb_s, m.rb_a, m.rb_r, m.rb_s2, m.rb_d, s + off * FX_OBS_DIM, a + off, r + off,
                            s2 + off * FX_OBS_DIM, d + off);
}

// After an environment step of E accounts into a ring of `capacity` slots, and before
// this iteration's `minibatches` draws: one thread.
extern "C" __global__ void fx_dqn_loop_advance(fx_u64* loop, fx_u64 E, fx_u64 capacity, fx_u64 minibatches) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    loop[FX_LOOP_ENV_STEP] += 1;
    loop[FX_LOOP_POS] = (loop[FX_LOOP_POS] + E) % capacity;
    fx_u64 len = loop[FX_LOOP_LEN] + E;
    loop[FX_LOOP_LEN] = len < capacity ? len : capacity;
    loop[FX_LOOP_BASE] = loop[FX_LOOP_KEY];
    loop[FX_LOOP_KEY] += minibatches;
}
