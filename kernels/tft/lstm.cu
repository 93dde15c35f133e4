// One step of a whole-sequence LSTM (PyTorch layout, gates i, f, g, o), forward and
// backward (crates/fx-models/src/tft/ops.rs, `Lstm`, is the reference). The input
// projection of every step is one GEMM outside; a step adds both biases and the recurrent
// product, so a step is one launch: a tile of 8 rows x 32 hidden units per block, the
// recurrent GEMM over shared-memory chunks of 32, then the cell in registers. Steps
// t < L use the encoder's parameters (index 0), later ones the decoder's (index 1).
#include "fx_rng.cuh"

#define FX_TILE_U 32
#define FX_TILE_R 8
#define FX_KC 32

__device__ __forceinline__ float fx_lstm_sigmoid(float x) { return 1.0f / (expf(-x) + 1.0f); }

// block (32, 8), grid (ceil(d / 32), ceil(B / 8)).
extern "C" __global__ void fx_lstm_fwd_step(const float* __restrict__ xg, const float* __restrict__ w_hh0,
                                            const float* __restrict__ w_hh1, const float* __restrict__ b_ih0,
                                            const float* __restrict__ b_ih1, const float* __restrict__ b_hh0,
                                            const float* __restrict__ b_hh1, float* __restrict__ h,
                                            float* __restrict__ c, float* __restrict__ gates, fx_u32 t, fx_u32 L,
                                            fx_u32 B, fx_u32 d) {
    __shared__ float hs[FX_TILE_R][FX_KC + 1];
    __shared__ float ws[FX_KC][4 * FX_TILE_U + 1];
    const fx_u32 tx = threadIdx.x, ty = threadIdx.y, tid = ty * FX_TILE_U + tx;
    const fx_u32 u0 = blockIdx.x * FX_TILE_U, r0 = blockIdx.y * FX_TILE_R;
    const fx_u32 u = u0 + tx, row = r0 + ty;
    const bool enc = t < L;
    const float* w = enc ? w_hh0 : w_hh1;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (t > 0) {
        const float* hp = h + (fx_u64)(t - 1) * B * d;
        for (fx_u32 kc = 0; kc < d; kc += FX_KC) {
            hs[ty][tx] = (row < B && kc + tx < d) ? hp[(fx_u64)row * d + kc + tx] : 0.0f;
            // The W_hh rows of this tile's 4 x 32 gate columns, k-chunk [kc, kc + 32).
            for (fx_u32 e = tid; e < FX_KC * 4 * FX_TILE_U; e += FX_TILE_U * FX_TILE_R) {
                const fx_u32 kk = e % FX_KC, col = e / FX_KC, g = col / FX_TILE_U, uu = col % FX_TILE_U;
                const fx_u32 wu = u0 + uu;
                ws[kk][col] = (wu < d && kc + kk < d) ? w[(fx_u64)(g * d + wu) * d + kc + kk] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (fx_u32 kk = 0; kk < FX_KC; ++kk) {
                const float hv = hs[ty][kk];
#pragma unroll
                for (int g = 0; g < 4; ++g) acc[g] += hv * ws[kk][g * FX_TILE_U + tx];
            }
            __syncthreads();
        }
    }
    if (row >= B || u >= d) return;
    const float* bi = enc ? b_ih0 : b_ih1;
    const float* bh = enc ? b_hh0 : b_hh1;
    const fx_u64 r = (fx_u64)t * B + row;
    float pre[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        const fx_u32 col = g * d + u;
        pre[g] = xg[r * 4 * d + col] + (bi[col] + bh[col]) + acc[g];
    }
    const float i = fx_lstm_sigmoid(pre[0]), f = fx_lstm_sigmoid(pre[1]), gg = tanhf(pre[2]),
                o = fx_lstm_sigmoid(pre[3]);
    const float c_prev = t > 0 ? c[(r - B) * d + u] : 0.0f;
    const float cn = f * c_prev + i * gg;
    c[r * d + u] = cn;
    h[r * d + u] = o * tanhf(cn);
    gates[r * 4 * d + u] = i;
    gates[r * 4 * d + d + u] = f;
    gates[r * 4 * d + 2 * d + u] = gg;
    gates[r * 4 * d + 3 * d + u] = o;
}

// block (32, 8), grid (ceil(d / 32), ceil(B / 8)); steps T. dh = dh_out[t] + dgates[t+1] W_hh(t+1)
// (the next step's weights), then the cell's backward; writes dgates[t] and the carried dc.
extern "C" __global__ void fx_lstm_bwd_step(const float* __restrict__ dh_out, float* __restrict__ dgates,
                                            float* __restrict__ dc, const float* __restrict__ gates,
                                            const float* __restrict__ c, const float* __restrict__ w_hh0,
                                            const float* __restrict__ w_hh1, fx_u32 t, fx_u32 L, fx_u32 T, fx_u32 B,
                                            fx_u32 d) {
    __shared__ float gs[FX_TILE_R][FX_KC + 1];
    __shared__ float ws[FX_KC][FX_TILE_U + 1];
    const fx_u32 tx = threadIdx.x, ty = threadIdx.y;
    const fx_u32 u0 = blockIdx.x * FX_TILE_U, r0 = blockIdx.y * FX_TILE_R;
    const fx_u32 u = u0 + tx, row = r0 + ty;
    const bool has_next = t + 1 < T;
    float rec = 0.0f;
    if (has_next) {
        const float* w = (t + 1 < L) ? w_hh0 : w_hh1;
        const float* gn = dgates + (fx_u64)(t + 1) * B * 4 * d;
        for (fx_u32 kc = 0; kc < 4 * d; kc += FX_KC) {
            gs[ty][tx] = (row < B && kc + tx < 4 * d) ? gn[(fx_u64)row * 4 * d + kc + tx] : 0.0f;
            for (fx_u32 kk = ty; kk < FX_KC; kk += FX_TILE_R) {
                ws[kk][tx] = (u < d && kc + kk < 4 * d) ? w[(fx_u64)(kc + kk) * d + u] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (fx_u32 kk = 0; kk < FX_KC; ++kk) rec += gs[ty][kk] * ws[kk][tx];
            __syncthreads();
        }
    }
    if (row >= B || u >= d) return;
    const fx_u64 r = (fx_u64)t * B + row;
    const float dh = dh_out[r * d + u] + rec;
    const float i = gates[r * 4 * d + u], f = gates[r * 4 * d + d + u], gg = gates[r * 4 * d + 2 * d + u],
                o = gates[r * 4 * d + 3 * d + u];
    const float cv = c[r * d + u];
    const float c_prev = t > 0 ? c[(r - B) * d + u] : 0.0f;
    const float tc = tanhf(cv);
    const float dc_next = has_next ? dc[(fx_u64)row * d + u] : 0.0f;
    const float dcv = dc_next + dh * o * (1.0f - tc * tc);
    dgates[r * 4 * d + u] = dcv * gg * i * (1.0f - i);
    dgates[r * 4 * d + d + u] = dcv * c_prev * f * (1.0f - f);
    dgates[r * 4 * d + 2 * d + u] = dcv * i * (1.0f - gg * gg);
    dgates[r * 4 * d + 3 * d + u] = dh * tc * o * (1.0f - o);
    dc[(fx_u64)row * d + u] = dcv * f;
}
