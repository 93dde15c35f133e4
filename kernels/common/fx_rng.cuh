// Counter-based random draws shared by every kernel (crates/fx-kernels/src/rng.rs, MODELS.md
// "Trading environment"): a draw is a pure function of (seed, stream, env, step), so the CPU
// reference and the kernels agree without sharing generator state, and a replayed CUDA
// graph draws fresh numbers from counters kept in device memory.
#pragma once

typedef unsigned long long fx_u64;
typedef unsigned int fx_u32;

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
