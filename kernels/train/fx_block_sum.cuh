// A block's sum of one float per thread (warp shuffles, then one warp over the warps' sums):
// the reduction of the optimiser kernels' partial norms (optim.cu, pop_optim.cu). `smem`
// holds 32 floats; the result is valid in thread 0.
#pragma once

__device__ __forceinline__ float block_sum(float v, float* smem) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = 0.0f;
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? smem[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}
