// Counter-based dropout masks (crates/fx-precision/src/dropout.rs is the reference): the
// training step is read from device memory, so a replayed CUDA graph draws fresh masks.
#include "fx_rng.cuh"

#define FX_STREAM_DROPOUT 4ULL

// mask[i] = scale where draw(seed, 4, call, step·2^32 + i) >= p, else 0.
extern "C" __global__ void fx_dropout_mask(float* __restrict__ mask, fx_u64 n, fx_u64 seed, fx_u64 call,
                                           const fx_u32* __restrict__ step, double p, float scale) {
    const fx_u64 hi = ((fx_u64)step[0]) << 32;
    for (fx_u64 i = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fx_u64)gridDim.x * blockDim.x) {
        mask[i] = fx_draw(seed, FX_STREAM_DROPOUT, call, hi | i) >= p ? scale : 0.0f;
    }
}

// step[0] += 1 (one thread): the end of a training step, inside the captured graph.
extern "C" __global__ void fx_dropout_advance(fx_u32* step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) step[0] += 1u;
}
