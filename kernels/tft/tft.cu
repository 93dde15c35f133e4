// The TFT's fused training-step kernels (crates/fx-models/src/tft/ops.rs is the reference
// and documents every layout): input packing, per-variable embeddings, bias + ELU/dropout
// epilogues, GLU + residual + LayerNorm (+ softmax), the variable-selection mix,
// interpretable attention and the pinball loss, each with its backward. F32 throughout.
// Weight-gradient reductions go through per-block partial sums and a second pass in a fixed
// order (fx_tft_reduce_partials): no float atomics, so a step is bit-reproducible.
#include "fx_rng.cuh"

#define FX_STREAM_DROPOUT 4ULL
#define FX_PARTIAL_ROWS 64
// The LayerNorm-type kernels hold a row in registers, V values per lane (rows up to 32 V
// wide); each comes in V = 2, 4, 8 (suffix), so a 128-wide row does not pay 256-wide
// register use (occupancy). The launcher picks the smallest V that fits.
// Most attention steps (per-warp shared scores).
#define FX_MAX_STEPS 256

// F32 -> BF16 bits, round to nearest even, NaN kept quiet (half::bf16::from_f32).
__device__ __forceinline__ unsigned short fx_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// dst[i] = bf16(src[i]): a GEMM operand's BF16 copy.
extern "C" __global__ void fx_tft_cast_bf16(const float* __restrict__ src, unsigned short* __restrict__ dst,
                                            fx_u64 n) {
    for (fx_u64 i = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fx_u64)gridDim.x * blockDim.x)
        dst[i] = fx_bf16(src[i]);
}

__device__ __forceinline__ float fx_sigmoid(float x) { return 1.0f / (expf(-x) + 1.0f); }

__device__ __forceinline__ float fx_elu(float x) { return signbit(x) ? expf(x) - 1.0f : x; }

__device__ __forceinline__ float fx_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fx_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The dropout draw index of element (row, 0) of a [groups * steps * B, cols] time-major
// buffer: candle's batch-major index ((j*B + b)*steps + s)*cols; column k adds k.
__device__ __forceinline__ fx_u64 fx_drop_base(fx_u64 batch, fx_u64 steps, fx_u64 row, fx_u64 cols) {
    const fx_u64 per_group = steps * batch;
    const fx_u64 j = row / per_group, rr = row % per_group;
    const fx_u64 s = rr / batch, b = rr % batch;
    return ((j * batch + b) * steps + s) * cols;
}

extern "C" __global__ void fx_tft_pack(const float* __restrict__ observed, const float* __restrict__ known,
                                       float* __restrict__ raw_enc, float* __restrict__ raw_dec, fx_u32 B, fx_u32 L,
                                       fx_u32 H, fx_u32 n_obs, fx_u32 n_known) {
    const fx_u64 ne = n_obs + n_known, steps = L + H;
    const fx_u64 n_enc = (fx_u64)L * B * ne, n_dec = (fx_u64)H * B * n_known;
    for (fx_u64 i = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n_enc + n_dec;
         i += (fx_u64)gridDim.x * blockDim.x) {
        if (i < n_enc) {
            const fx_u64 row = i / ne, j = i % ne, s = row / B, b = row % B;
            raw_enc[i] = j < n_obs ? observed[(b * L + s) * n_obs + j] : known[(b * steps + s) * n_known + j - n_obs];
        } else {
            const fx_u64 k = i - n_enc, row = k / n_known, j = k % n_known, s = row / B, b = row % B;
            raw_dec[k] = known[(b * steps + L + s) * n_known + j];
        }
    }
}

// Grid-stride over the (row, variable) rows of d columns, threads over the columns: index
// arithmetic once per row, not per element (64-bit division is slow on the GPU).
extern "C" __global__ void fx_tft_embed_fwd(const float* __restrict__ raw, const float* __restrict__ w,
                                            const float* __restrict__ b, float* __restrict__ emb, fx_u64 rows,
                                            fx_u32 n, fx_u32 d, unsigned short* __restrict__ emb16) {
    const fx_u64 total_rows = rows * n;
    for (fx_u64 rj = blockIdx.x; rj < total_rows; rj += gridDim.x) {
        const fx_u64 j = rj % n;
        const float x = raw[rj];
        for (fx_u32 k = threadIdx.x; k < d; k += blockDim.x) {
            const float v = x * w[j * d + k] + b[j * d + k];
            emb[rj * d + k] = v;
            if (emb16) emb16[rj * d + k] = fx_bf16(v);
        }
    }
}

// grid (row blocks, n); thread per column k (looping if d > blockDim.x).
extern "C" __global__ void fx_tft_embed_bwd(const float* __restrict__ raw, const float* __restrict__ demb,
                                            float* __restrict__ partials, fx_u64 rows, fx_u32 n, fx_u32 d) {
    const fx_u64 bi = blockIdx.x, j = blockIdx.y, nb = gridDim.x;
    const fx_u64 r0 = bi * FX_PARTIAL_ROWS, r1 = min(rows, r0 + FX_PARTIAL_ROWS);
    float* out = partials + ((j * nb + bi) * 2) * d;
    for (fx_u32 k = threadIdx.x; k < d; k += blockDim.x) {
        float sw = 0.0f, sb = 0.0f;
        for (fx_u64 r = r0; r < r1; ++r) {
            const float de = demb[(r * n + j) * d + k];
            sw += de * raw[r * n + j];
            sb += de;
        }
        out[k] = sw;
        out[d + k] = sb;
    }
}

// w[g, k] = sum over blocks of partials[g][block][0][k]; b[g, k] likewise from [1].
extern "C" __global__ void fx_tft_reduce_partials(const float* __restrict__ partials, fx_u32 groups, fx_u32 blocks,
                                                  fx_u32 width, float* __restrict__ w, float* __restrict__ b) {
    const fx_u64 total = (fx_u64)groups * width;
    for (fx_u64 i = (fx_u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (fx_u64)gridDim.x * blockDim.x) {
        const fx_u64 g = i / width, k = i % width;
        float sw = 0.0f, sb = 0.0f;
        for (fx_u64 bi = 0; bi < blocks; ++bi) {
            const fx_u64 base = ((g * blocks + bi) * 2) * width;
            sw += partials[base + k];
            sb += partials[base + width + k];
        }
        w[i] = sw;
        b[i] = sb;
    }
}

// y = drop(act(y + bias[row / rows_per_group])) in place; grid-stride over rows, threads
// over columns (the row's group and dropout base index computed once per row).
extern "C" __global__ void fx_tft_bias_act(float* __restrict__ y, const float* __restrict__ bias, fx_u64 rows,
                                           fx_u32 cols, fx_u64 rows_per_group, fx_u32 act, fx_u32 drop_on,
                                           fx_u64 seed, fx_u64 call, const fx_u32* __restrict__ step_ptr, double p,
                                           float scale, fx_u64 batch, fx_u64 steps, unsigned short* __restrict__ y16) {
    const fx_u64 hi = drop_on ? ((fx_u64)step_ptr[0]) << 32 : 0;
    for (fx_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* br = bias + (r / rows_per_group) * cols;
        const fx_u64 base = drop_on ? fx_drop_base(batch, steps, r, cols) : 0;
        for (fx_u32 k = threadIdx.x; k < cols; k += blockDim.x) {
            const fx_u64 i = r * cols + k;
            float v = y[i] + br[k];
            if (act == 1u) v = fx_elu(v);
            if (drop_on) v *= fx_draw(seed, FX_STREAM_DROPOUT, call, hi | (base + k)) >= p ? scale : 0.0f;
            y[i] = v;
            if (y16) y16[i] = fx_bf16(v);
        }
    }
}

// grad *= act'(from output y) * mask, in place; rows and columns as fx_tft_bias_act.
extern "C" __global__ void fx_tft_act_bwd(float* __restrict__ grad, const float* __restrict__ y, fx_u64 rows,
                                          fx_u32 cols, fx_u32 act, fx_u32 drop_on, fx_u64 seed, fx_u64 call,
                                          const fx_u32* __restrict__ step_ptr, double p, float scale, fx_u64 batch,
                                          fx_u64 steps, unsigned short* __restrict__ g16) {
    const fx_u64 hi = drop_on ? ((fx_u64)step_ptr[0]) << 32 : 0;
    for (fx_u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const fx_u64 base = drop_on ? fx_drop_base(batch, steps, r, cols) : 0;
        for (fx_u32 k = threadIdx.x; k < cols; k += blockDim.x) {
            const fx_u64 i = r * cols + k;
            float g = grad[i];
            if (act == 1u) {
                const float v = y[i];
                g *= v > 0.0f ? 1.0f : v + 1.0f;
            }
            if (drop_on) g *= fx_draw(seed, FX_STREAM_DROPOUT, call, hi | (base + k)) >= p ? scale : 0.0f;
            grad[i] = g;
            if (g16) g16[i] = fx_bf16(g);
        }
    }
}

template <int V>
struct FxGluRow {
    float z[V], s[V], v5[V];
};

// Lane `lane`'s columns k = lane + 32 i of a row of width o: z = res[rr] (+ rb) +
// sigmoid(g4[gr] + b4) * (g5[gr] + b5), with gr / rr the row's index in g4, g5 / in res.
template <int V>
__device__ __forceinline__ void fx_glu_row(FxGluRow<V>& t, fx_u64 gr, fx_u64 rr, fx_u32 o, int lane, const float* g4,
                                           const float* b4, const float* g5, const float* b5, const float* res,
                                           const float* res_bias) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const fx_u32 k = lane + 32 * i;
        t.z[i] = 0.0f;
        t.s[i] = 0.0f;
        t.v5[i] = 0.0f;
        if (k < o) {
            const fx_u64 x = gr * o + k;
            t.s[i] = fx_sigmoid(g4[x] + b4[k]);
            t.v5[i] = g5[x] + b5[k];
            const float rv = res_bias ? res[rr * o + k] + res_bias[k] : res[rr * o + k];
            t.z[i] = rv + t.s[i] * t.v5[i];
        }
    }
}

// Mean and 1/sqrt(var + eps) of a row held across the warp (n valid values).
template <int V>
__device__ __forceinline__ void fx_row_stats(const float* z, fx_u32 o, int lane, float eps, float* mean,
                                             float* rstd) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i)
        if (lane + 32 * i < (int)o) s += z[i];
    const float m = fx_warp_sum(s) / (float)o;
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i)
        if (lane + 32 * i < (int)o) v += (z[i] - m) * (z[i] - m);
    *mean = m;
    *rstd = 1.0f / sqrtf(fx_warp_sum(v) / (float)o + eps);
}

// Softmax over a row held across the warp, in place.
template <int V>
__device__ __forceinline__ void fx_row_softmax(float* y, fx_u32 o, int lane) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < V; ++i)
        if (lane + 32 * i < (int)o) m = fmaxf(m, y[i]);
    m = fx_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        if (lane + 32 * i < (int)o) {
            y[i] = expf(y[i] - m);
            s += y[i];
        }
    }
    s = fx_warp_sum(s);
#pragma unroll
    for (int i = 0; i < V; ++i) y[i] /= s;
}

// One warp per row.
template <int V>
__device__ __forceinline__ void fx_glu_ln_fwd_impl(fx_u64 rows, fx_u32 o, const float* __restrict__ g4,
                                             const float* __restrict__ b4, const float* __restrict__ g5,
                                             const float* __restrict__ b5, const float* __restrict__ res,
                                             const float* __restrict__ res_bias, const float* __restrict__ ln_w,
                                             const float* __restrict__ ln_b, float eps, fx_u32 softmax,
                                             float* __restrict__ out, float* __restrict__ stats,
                                             unsigned short* __restrict__ out16) {
    const int lane = threadIdx.x & 31;
    const fx_u64 warps = (fx_u64)gridDim.x * (blockDim.x >> 5);
    for (fx_u64 r = (fx_u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        FxGluRow<V> t;
        fx_glu_row<V>(t, r, r, o, lane, g4, b4, g5, b5, res, res_bias);
        float mean, rstd;
        fx_row_stats<V>(t.z, o, lane, eps, &mean, &rstd);
        float y[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            y[i] = k < o ? (t.z[i] - mean) * rstd * ln_w[k] + ln_b[k] : 0.0f;
        }
        if (softmax) fx_row_softmax<V>(y, o, lane);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            if (k < o) {
                out[r * o + k] = y[i];
                if (out16) out16[r * o + k] = fx_bf16(y[i]);
            }
        }
        if (lane == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// LayerNorm backward of a row across the warp: dz from dy; accumulates dw, db per lane.
template <int V>
__device__ __forceinline__ void fx_ln_bwd_row(const float* dy, const float* xn, const float* w, float rstd, fx_u32 o,
                                              int lane, float* dz, float* dw, float* db) {
    float mg = 0.0f, mgx = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        if (lane + 32 * i < (int)o) {
            const float g = dy[i] * w[i];
            mg += g;
            mgx += g * xn[i];
            dw[i] += dy[i] * xn[i];
            db[i] += dy[i];
        }
    }
    mg = fx_warp_sum(mg) / (float)o;
    mgx = fx_warp_sum(mgx) / (float)o;
#pragma unroll
    for (int i = 0; i < V; ++i) dz[i] = (dy[i] * w[i] - mg - xn[i] * mgx) * rstd;
}

// Sums each warp's dw/db registers into partials[base .. base + 2o] (block-wide, via smem
// [warps][2][o]); the block's threads all call it.
template <int V>
__device__ __forceinline__ void fx_block_partials(const float* dw, const float* db, fx_u32 o, float* smem,
                                                  float* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const fx_u32 k = lane + 32 * i;
        if (k < o) {
            smem[(warp * 2) * o + k] = dw[i];
            smem[(warp * 2 + 1) * o + k] = db[i];
        }
    }
    __syncthreads();
    for (fx_u32 k = threadIdx.x; k < 2 * o; k += blockDim.x) {
        float s = 0.0f;
        for (int wi = 0; wi < warps; ++wi) s += smem[wi * 2 * o + k];
        out[k] = s;
    }
    __syncthreads();
}

// grid: row blocks of FX_PARTIAL_ROWS rows; 8 warps; dynamic smem 8 * 2 * o floats.
template <int V>
__device__ __forceinline__ void fx_glu_ln_bwd_impl(fx_u64 rows, fx_u32 o, const float* g4,
                                             const float* __restrict__ b4, const float* g5,
                                             const float* __restrict__ b5, const float* __restrict__ res,
                                             const float* __restrict__ res_bias, const float* __restrict__ ln_w,
                                             const float* __restrict__ ln_b, fx_u32 softmax,
                                             const float* __restrict__ stats, const float* __restrict__ dout,
                                             float* __restrict__ dres, fx_u32 res_acc, float* dg4, float* dg5,
                                             float* __restrict__ partials, unsigned short* __restrict__ dg4_16,
                                             unsigned short* __restrict__ dg5_16) {
    extern __shared__ float smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const fx_u64 r0 = (fx_u64)blockIdx.x * FX_PARTIAL_ROWS, r1 = min(rows, r0 + FX_PARTIAL_ROWS);
    float w[V], lb[V], dw[V], db[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const fx_u32 k = lane + 32 * i;
        w[i] = k < o ? ln_w[k] : 0.0f;
        lb[i] = k < o ? ln_b[k] : 0.0f;
        dw[i] = 0.0f;
        db[i] = 0.0f;
    }
    for (fx_u64 r = r0 + warp; r < r1; r += warps) {
        FxGluRow<V> t;
        fx_glu_row<V>(t, r, r, o, lane, g4, b4, g5, b5, res, res_bias);
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
        float xn[V], dy[V], dz[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            xn[i] = k < o ? (t.z[i] - mean) * rstd : 0.0f;
            dy[i] = k < o ? dout[r * o + k] : 0.0f;
        }
        if (softmax) {
            float p[V];
#pragma unroll
            for (int i = 0; i < V; ++i) p[i] = xn[i] * w[i] + lb[i];
            fx_row_softmax<V>(p, o, lane);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < V; ++i)
                if (lane + 32 * i < (int)o) dot += p[i] * dy[i];
            dot = fx_warp_sum(dot);
#pragma unroll
            for (int i = 0; i < V; ++i) dy[i] = lane + 32 * i < (int)o ? p[i] * (dy[i] - dot) : 0.0f;
        }
        fx_ln_bwd_row<V>(dy, xn, w, rstd, o, lane, dz, dw, db);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            if (k < o) {
                const fx_u64 x = r * o + k;
                const float prev = res_acc ? dres[x] : 0.0f;
                dres[x] = prev + dz[i];
                const float a = dz[i] * t.v5[i] * t.s[i] * (1.0f - t.s[i]), c = dz[i] * t.s[i];
                dg4[x] = a;
                dg5[x] = c;
                if (dg4_16) {
                    dg4_16[x] = fx_bf16(a);
                    dg5_16[x] = fx_bf16(c);
                }
            }
        }
    }
    fx_block_partials<V>(dw, db, o, smem, partials + (fx_u64)blockIdx.x * 2 * o);
}

// One warp per row: out[r] = sum_j wsel[r, j] * LN_j(emb[r, j] + sigmoid(g4 + b4) * (g5 + b5)).
template <int V>
__device__ __forceinline__ void fx_vsn_mix_fwd_impl(fx_u64 rows, fx_u32 n, fx_u32 d, const float* __restrict__ emb,
                                              const float* __restrict__ g4, const float* __restrict__ b4,
                                              const float* __restrict__ g5, const float* __restrict__ b5,
                                              const float* __restrict__ ln_w, const float* __restrict__ ln_b,
                                              float eps, const float* __restrict__ wsel, float* __restrict__ out,
                                              float* __restrict__ stats, unsigned short* __restrict__ out16) {
    const int lane = threadIdx.x & 31;
    const fx_u64 warps = (fx_u64)gridDim.x * (blockDim.x >> 5);
    for (fx_u64 r = (fx_u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        float acc[V];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = 0.0f;
        for (fx_u32 j = 0; j < n; ++j) {
            FxGluRow<V> t;
            // The variable's GRN rows live at (j * rows + r); its residual is emb[r, j].
            fx_glu_row<V>(t, j * rows + r, r * n + j, d, lane, g4, b4 + (fx_u64)j * d, g5, b5 + (fx_u64)j * d, emb,
                       nullptr);
            float mean, rstd;
            fx_row_stats<V>(t.z, d, lane, eps, &mean, &rstd);
            const float wj = wsel[r * n + j];
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const fx_u32 k = lane + 32 * i;
                if (k < d) acc[i] += wj * ((t.z[i] - mean) * rstd * ln_w[j * d + k] + ln_b[j * d + k]);
            }
            if (lane == 0) {
                stats[2 * (j * rows + r)] = mean;
                stats[2 * (j * rows + r) + 1] = rstd;
            }
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            if (k < d) {
                out[r * d + k] = acc[i];
                if (out16) out16[r * d + k] = fx_bf16(acc[i]);
            }
        }
    }
}

// grid (row blocks, n): block (bi, j) does variable j of rows [bi*64, ...); 8 warps;
// dynamic smem 8 * 2 * d floats.
template <int V>
__device__ __forceinline__ void fx_vsn_mix_bwd_impl(fx_u64 rows, fx_u32 n, fx_u32 d, const float* __restrict__ emb,
                                              const float* g4, const float* __restrict__ b4,
                                              const float* g5, const float* __restrict__ b5,
                                              const float* __restrict__ ln_w, const float* __restrict__ ln_b,
                                              const float* __restrict__ wsel, const float* __restrict__ stats,
                                              const float* __restrict__ dout, float* __restrict__ dwsel,
                                              float* __restrict__ demb, float* dg4, float* dg5,
                                              float* __restrict__ partials, unsigned short* __restrict__ dg4_16,
                                              unsigned short* __restrict__ dg5_16) {
    extern __shared__ float smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const fx_u64 j = blockIdx.y, nb = gridDim.x, bi = blockIdx.x;
    const fx_u64 r0 = bi * FX_PARTIAL_ROWS, r1 = min(rows, r0 + FX_PARTIAL_ROWS);
    float w[V], lb[V], dw[V], db[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const fx_u32 k = lane + 32 * i;
        w[i] = k < d ? ln_w[j * d + k] : 0.0f;
        lb[i] = k < d ? ln_b[j * d + k] : 0.0f;
        dw[i] = 0.0f;
        db[i] = 0.0f;
    }
    for (fx_u64 r = r0 + warp; r < r1; r += warps) {
        const fx_u64 gr = j * rows + r;
        FxGluRow<V> t;
        fx_glu_row<V>(t, gr, r * n + j, d, lane, g4, b4 + j * d, g5, b5 + j * d, emb, nullptr);
        const float mean = stats[2 * gr], rstd = stats[2 * gr + 1];
        const float wj = wsel[r * n + j];
        float xn[V], dy[V], dz[V];
        float dsel = 0.0f;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            xn[i] = k < d ? (t.z[i] - mean) * rstd : 0.0f;
            const float g = k < d ? dout[r * d + k] : 0.0f;
            dsel += g * (xn[i] * w[i] + lb[i]);
            dy[i] = g * wj;
        }
        dsel = fx_warp_sum(dsel);
        if (lane == 0) dwsel[r * n + j] = dsel;
        fx_ln_bwd_row<V>(dy, xn, w, rstd, d, lane, dz, dw, db);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const fx_u32 k = lane + 32 * i;
            if (k < d) {
                const fx_u64 x = gr * d + k;
                demb[(r * n + j) * d + k] = dz[i];
                const float a = dz[i] * t.v5[i] * t.s[i] * (1.0f - t.s[i]), c = dz[i] * t.s[i];
                dg4[x] = a;
                dg5[x] = c;
                if (dg4_16) {
                    dg4_16[x] = fx_bf16(a);
                    dg5_16[x] = fx_bf16(c);
                }
            }
        }
    }
    fx_block_partials<V>(dw, db, d, smem, partials + ((j * nb + bi) * 2) * d);
}

// The entry points, one per row-register width (V = 2, 4, 8: names ending in V).
#define FX_ROW_KERNELS(name, impl, params, args)                \
    extern "C" __global__ void name##2 params { impl<2> args; } \
    extern "C" __global__ void name##4 params { impl<4> args; } \
    extern "C" __global__ void name##8 params { impl<8> args; }

FX_ROW_KERNELS(fx_tft_glu_ln_fwd, fx_glu_ln_fwd_impl,
               (fx_u64 rows, fx_u32 o, const float* __restrict__ g4,
                                             const float* __restrict__ b4, const float* __restrict__ g5,
                                             const float* __restrict__ b5, const float* __restrict__ res,
                                             const float* __restrict__ res_bias, const float* __restrict__ ln_w,
                                             const float* __restrict__ ln_b, float eps, fx_u32 softmax,
                                             float* __restrict__ out, float* __restrict__ stats,
                                             unsigned short* __restrict__ out16),
               (rows, o, g4, b4, g5, b5, res, res_bias, ln_w, ln_b, eps, softmax, out, stats, out16))

FX_ROW_KERNELS(fx_tft_glu_ln_bwd, fx_glu_ln_bwd_impl,
               (fx_u64 rows, fx_u32 o, const float* g4,
                                             const float* __restrict__ b4, const float* g5,
                                             const float* __restrict__ b5, const float* __restrict__ res,
                                             const float* __restrict__ res_bias, const float* __restrict__ ln_w,
                                             const float* __restrict__ ln_b, fx_u32 softmax,
                                             const float* __restrict__ stats, const float* __restrict__ dout,
                                             float* __restrict__ dres, fx_u32 res_acc, float* dg4, float* dg5,
                                             float* __restrict__ partials, unsigned short* __restrict__ dg4_16,
                                             unsigned short* __restrict__ dg5_16),
               (rows, o, g4, b4, g5, b5, res, res_bias, ln_w, ln_b, softmax, stats, dout, dres, res_acc, dg4, dg5, partials, dg4_16, dg5_16))

FX_ROW_KERNELS(fx_tft_vsn_mix_fwd, fx_vsn_mix_fwd_impl,
               (fx_u64 rows, fx_u32 n, fx_u32 d, const float* __restrict__ emb,
                                              const float* __restrict__ g4, const float* __restrict__ b4,
                                              const float* __restrict__ g5, const float* __restrict__ b5,
                                              const float* __restrict__ ln_w, const float* __restrict__ ln_b,
                                              float eps, const float* __restrict__ wsel, float* __restrict__ out,
                                              float* __restrict__ stats, unsigned short* __restrict__ out16),
               (rows, n, d, emb, g4, b4, g5, b5, ln_w, ln_b, eps, wsel, out, stats, out16))

FX_ROW_KERNELS(fx_tft_vsn_mix_bwd, fx_vsn_mix_bwd_impl,
               (fx_u64 rows, fx_u32 n, fx_u32 d, const float* __restrict__ emb,
                                              const float* g4, const float* __restrict__ b4,
                                              const float* g5, const float* __restrict__ b5,
                                              const float* __restrict__ ln_w, const float* __restrict__ ln_b,
                                              const float* __restrict__ wsel, const float* __restrict__ stats,
                                              const float* __restrict__ dout, float* __restrict__ dwsel,
                                              float* __restrict__ demb, float* dg4, float* dg5,
                                              float* __restrict__ partials, unsigned short* __restrict__ dg4_16,
                                              unsigned short* __restrict__ dg5_16),
               (rows, n, d, emb, g4, b4, g5, b5, ln_w, ln_b, wsel, stats, dout, dwsel, demb, dg4, dg5, partials, dg4_16, dg5_16))

// One warp per (b, decoder step s); per-warp shared scores.
extern "C" __global__ void fx_tft_attn_fwd(fx_u32 B, fx_u32 L, fx_u32 H, fx_u32 n_head, fx_u32 dk, float scale,
                                           const float* __restrict__ q, const float* __restrict__ bq,
                                           const float* __restrict__ k, const float* __restrict__ bk,
                                           const float* __restrict__ v, const float* __restrict__ bv,
                                           float* __restrict__ attn, float* __restrict__ avg) {
    __shared__ float p_sm[8][FX_MAX_STEPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const fx_u32 steps = L + H, width = n_head * dk;
    const fx_u64 pairs = (fx_u64)B * H, warps = (fx_u64)gridDim.x * (blockDim.x >> 5);
    float* p = p_sm[warp];
    for (fx_u64 pi = (fx_u64)blockIdx.x * (blockDim.x >> 5) + warp; pi < pairs; pi += warps) {
        const fx_u32 b = pi % B, s = pi / B;
        const fx_u64 qrow = (fx_u64)s * B + b;
        const fx_u32 visible = L + s + 1;
        float acc[2] = {0.0f, 0.0f};  // avg columns c = lane, lane + 32 (dk <= 64)
        for (fx_u32 hd = 0; hd < n_head; ++hd) {
            float m = -INFINITY;
            for (fx_u32 t = lane; t < visible; t += 32) {
                const fx_u64 krow = (fx_u64)t * B + b;
                float dot = 0.0f;
                for (fx_u32 c = 0; c < dk; ++c) {
                    const fx_u32 col = hd * dk + c;
                    dot += (q[qrow * width + col] + bq[col]) * (k[krow * width + col] + bk[col]);
                }
                p[t] = dot * scale;
                m = fmaxf(m, p[t]);
            }
            m = fx_warp_max(m);
            float sum = 0.0f;
            for (fx_u32 t = lane; t < visible; t += 32) {
                p[t] = expf(p[t] - m);
                sum += p[t];
            }
            sum = fx_warp_sum(sum);
            const fx_u64 abase = (((fx_u64)b * n_head + hd) * H + s) * steps;
            for (fx_u32 t = lane; t < steps; t += 32) {
                const float a = t < visible ? p[t] / sum : 0.0f;
                if (t < visible) p[t] = a;
                attn[abase + t] = a;
            }
            __syncwarp();
#pragma unroll
            for (int ci = 0; ci < 2; ++ci) {
                const fx_u32 c = lane + 32 * ci;
                if (c < dk) {
                    float o = 0.0f;
                    for (fx_u32 t = 0; t < visible; ++t) o += p[t] * (v[((fx_u64)t * B + b) * dk + c] + bv[c]);
                    acc[ci] += o;
                }
            }
            __syncwarp();
        }
        const float inv = 1.0f / (float)n_head;
#pragma unroll
        for (int ci = 0; ci < 2; ++ci) {
            const fx_u32 c = lane + 32 * ci;
            if (c < dk) avg[qrow * dk + c] = acc[ci] * inv;
        }
    }
}

// One block per batch row b; dynamic smem n_head * H * steps floats (the score gradients).
extern "C" __global__ void fx_tft_attn_bwd(fx_u32 B, fx_u32 L, fx_u32 H, fx_u32 n_head, fx_u32 dk, float scale,
                                           const float* __restrict__ q, const float* __restrict__ bq,
                                           const float* __restrict__ k, const float* __restrict__ bk,
                                           const float* __restrict__ v, const float* __restrict__ bv,
                                           const float* __restrict__ attn, const float* __restrict__ davg,
                                           float* __restrict__ dq, float* __restrict__ dkk, float* __restrict__ dv) {
    extern __shared__ float ds[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const fx_u32 steps = L + H, width = n_head * dk;
    const fx_u32 b = blockIdx.x;
    const float inv = 1.0f / (float)n_head;
    for (fx_u32 pi = warp; pi < n_head * H; pi += warps) {
        const fx_u32 hd = pi / H, s = pi % H;
        const fx_u64 abase = (((fx_u64)b * n_head + hd) * H + s) * steps;
        const fx_u64 qrow = (fx_u64)s * B + b;
        float dot = 0.0f;
        for (fx_u32 t = lane; t < steps; t += 32) {
            float da = 0.0f;
            for (fx_u32 c = 0; c < dk; ++c) da += davg[qrow * dk + c] * inv * (v[((fx_u64)t * B + b) * dk + c] + bv[c]);
            ds[pi * steps + t] = da;
            dot += attn[abase + t] * da;
        }
        dot = fx_warp_sum(dot);
        for (fx_u32 t = lane; t < steps; t += 32) ds[pi * steps + t] = attn[abase + t] * (ds[pi * steps + t] - dot);
    }
    __syncthreads();
    for (fx_u32 e = threadIdx.x; e < steps * width; e += blockDim.x) {
        const fx_u32 t = e / width, col = e % width, hd = col / dk;
        float acc = 0.0f;
        for (fx_u32 s = 0; s < H; ++s) acc += ds[(hd * H + s) * steps + t] * (q[((fx_u64)s * B + b) * width + col] + bq[col]);
        dkk[((fx_u64)t * B + b) * width + col] = acc * scale;
    }
    for (fx_u32 e = threadIdx.x; e < steps * dk; e += blockDim.x) {
        const fx_u32 t = e / dk, c = e % dk;
        float acc = 0.0f;
        for (fx_u32 hd = 0; hd < n_head; ++hd)
            for (fx_u32 s = 0; s < H; ++s)
                acc += attn[(((fx_u64)b * n_head + hd) * H + s) * steps + t] * davg[((fx_u64)s * B + b) * dk + c] * inv;
        dv[((fx_u64)t * B + b) * dk + c] = acc;
    }
    for (fx_u32 e = threadIdx.x; e < H * width; e += blockDim.x) {
        const fx_u32 s = e / width, col = e % width, hd = col / dk;
        float acc = 0.0f;
        for (fx_u32 t = 0; t < steps; ++t) acc += ds[(hd * H + s) * steps + t] * (k[((fx_u64)t * B + b) * width + col] + bk[col]);
        dq[((fx_u64)s * B + b) * width + col] = acc * scale;
    }
}

// One block: the mean pinball loss and its gradient (candle's tie rule for max).
extern "C" __global__ void fx_tft_pinball(fx_u32 B, fx_u32 H, fx_u32 nq, const float* __restrict__ out,
                                          const float* __restrict__ bias, const float* __restrict__ target,
                                          const float* __restrict__ quantiles, float* __restrict__ loss,
                                          float* __restrict__ dout) {
    __shared__ float sm[1024];
    const fx_u32 n = B * H * nq;
    const float inv = 1.0f / (float)n;
    float sum = 0.0f;
    for (fx_u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const fx_u32 qi = i % nq, row = i / nq, s = row / B, b = row % B;
        const float q = quantiles[qi];
        const float e = target[b * H + s] - (out[i] + bias[qi]);
        const float l1 = e * q, l2 = e * (q - 1.0f);
        sum += fmaxf(l1, l2);
        const float slope = l1 > l2 ? q : (l2 > l1 ? q - 1.0f : 0.5f * q + 0.5f * (q - 1.0f));
        dout[i] = -inv * slope;
    }
    sm[threadIdx.x] = sum;
    __syncthreads();
    for (fx_u32 w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sm[threadIdx.x] += sm[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) loss[0] = sm[0] * inv;
}
