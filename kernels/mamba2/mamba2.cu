// The element-wise, norm and loss kernels of the fused MAMBA-2 training step
// (crates/fx-models/src/mamba2/ops_cuda.rs); the GEMMs around them are cuBLAS calls and the scan is
// kernels/mamba2/ssd.cu. Buffers are row-major F32 with rows r = b*len + t. Each kernel mirrors a
// function of crates/fx-models/src/mamba2/ops_ref.rs (f64), which documents the math.
//
// Determinism: no float atomics. Row reductions are warp shuffles in a fixed order; column
// (weight-gradient) reductions write one row of partial sums per block, which a second pass
// (column sums) adds up.
#include <cuda_bf16.h>

#define M2_WARPS 8
#define M2_THREADS (32 * M2_WARPS)
#define M2_ROWS_PER_BLOCK 32  // mamba2_ref::ROWS_PER_BLOCK
#define M2_CONV_TILE 32       // mamba2_ref::CONV_TILE
#define M2_MAX_CONV 8         // mamba2_ref::MAX_CONV

__device__ __forceinline__ float m2_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float m2_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float m2_silu(float x) { return x / (1.0f + expf(-x)); }

// RMSNorm forward, one warp per row: with `bias`, h += bias in place (the embedding's bias);
// `copy` (may be null) receives h; rstd = 1/sqrt(mean(h^2) + eps); u = h * rstd * w (`u16`, may
// be null, its BF16 copy). Grid: ceil(rows / 8) blocks of 256.
extern "C" __global__ void fx_m2_rmsnorm_fwd(float* __restrict__ h, const float* __restrict__ bias,
                                             const float* __restrict__ w, float* __restrict__ copy,
                                             float* __restrict__ u, __nv_bfloat16* __restrict__ u16,
                                             float* __restrict__ rstd, unsigned rows, unsigned cols, float eps) {
    const unsigned row = blockIdx.x * M2_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;  // whole warps leave together
    float* hr = h + (size_t)row * cols;
    float ss = 0.0f;
    for (unsigned c = lane; c < cols; c += 32) {
        float v = hr[c];
        if (bias) {
            v += bias[c];
            hr[c] = v;
        }
        if (copy) copy[(size_t)row * cols + c] = v;
        ss = fmaf(v, v, ss);
    }
    ss = m2_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    if (lane == 0) rstd[row] = r;
    for (unsigned c = lane; c < cols; c += 32) {
        const float x = hr[c] * r * w[c];
        u[(size_t)row * cols + c] = x;
        if (u16) u16[(size_t)row * cols + c] = __float2bfloat16_rn(x);
    }
}

// RMSNorm backward over blocks of 32 rows (a warp per row): du = du_full[r, c] or, when du_full
// is null, du_scale[r] * du_vec[c]; n = h * rstd, g = du * w,
// dh (+)= rstd * (g - n * mean(g * n)) (added when `accumulate`; `dh16`, may be null, gets the
// BF16 copy of the result); partials[block, c] = sum over the block's rows of du * n.
// Grid: ceil(rows / 32) blocks of 256, dynamic shared memory 8 * cols floats.
extern "C" __global__ void fx_m2_rmsnorm_bwd(const float* __restrict__ du_full, const float* __restrict__ du_scale,
                                             const float* __restrict__ du_vec, const float* __restrict__ h,
                                             const float* __restrict__ rstd, const float* __restrict__ w,
                                             float* __restrict__ dh, __nv_bfloat16* __restrict__ dh16,
                                             unsigned accumulate, float* __restrict__ partials, unsigned rows,
                                             unsigned cols) {
    extern __shared__ float acc[];  // [M2_WARPS][cols]
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (unsigned e = threadIdx.x; e < M2_WARPS * cols; e += M2_THREADS) acc[e] = 0.0f;
    __syncthreads();
    float* mine = acc + warp * cols;
    for (unsigned rr = warp; rr < M2_ROWS_PER_BLOCK; rr += M2_WARPS) {
        const unsigned row = blockIdx.x * M2_ROWS_PER_BLOCK + rr;
        if (row >= rows) break;  // uniform per warp
        const size_t o = (size_t)row * cols;
        const float r = rstd[row];
        const float sc = du_full ? 0.0f : du_scale[row];
        float s = 0.0f;
        for (unsigned c = lane; c < cols; c += 32) {
            const float d = du_full ? du_full[o + c] : sc * du_vec[c];
            s = fmaf(d * w[c], h[o + c] * r, s);
        }
        s = m2_warp_sum(s) / (float)cols;
        for (unsigned c = lane; c < cols; c += 32) {
            const float d = du_full ? du_full[o + c] : sc * du_vec[c];
            const float n = h[o + c] * r;
            float v = r * (d * w[c] - n * s);
            if (accumulate) v += dh[o + c];
            dh[o + c] = v;
            if (dh16) dh16[o + c] = __float2bfloat16_rn(v);
            mine[c] = fmaf(d, n, mine[c]);  // lane-owned columns: no race
        }
    }
    __syncthreads();
    for (unsigned c = threadIdx.x; c < cols; c += M2_THREADS) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < M2_WARPS; ++k) t += acc[k * cols + c];
        partials[(size_t)blockIdx.x * cols + c] = t;
    }
}

// Causal depthwise conv + SiLU and dt softplus, one thread per (row, column) for columns
// 0 .. cd + nh of the in_proj output zx [rows, ld] (xBC at column xoff, dt right after it):
// xbc[r, c] = silu(cb[c] + sum_j cw[c, j] * zx[r - (K-1) + j, xoff + c]) (zeros before the
// sequence start), dt[r, h] = softplus(zx[r, xoff + cd + h] + dt_bias[h]). Grid-stride.
extern "C" __global__ void fx_m2_conv_fwd(const float* __restrict__ zx, unsigned ld, unsigned xoff,
                                          const float* __restrict__ cw, const float* __restrict__ cb,
                                          const float* __restrict__ dt_bias, float* __restrict__ xbc,
                                          float* __restrict__ dt, unsigned rows, unsigned len, unsigned cd,
                                          unsigned nh, unsigned k) {
    const unsigned width = cd + nh;
    const size_t total = (size_t)rows * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / width;
        const unsigned c = (unsigned)(i % width);
        const unsigned t = (unsigned)(r % len);
        if (c < cd) {
            float s = cb[c];
            for (unsigned j = 0; j < k; ++j) {
                if (t + j >= k - 1) s = fmaf(cw[c * k + j], zx[(r + j + 1 - k) * ld + xoff + c], s);
            }
            xbc[r * cd + c] = m2_silu(s);
        } else {
            const unsigned hh = c - cd;
            const float v = zx[r * ld + xoff + c] + dt_bias[hh];
            dt[r * nh + hh] = fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v)));
        }
    }
}

// Conv backward, one thread per (batch row, tile of 32 steps, column c < cd), walking its tile
// plus K-1 steps of halo with the window of inputs and of pre-activation gradients in registers.
// The conv output's gradient is dxs [rows, di] for x columns and the sum over the group's heads of
// dbc [nh, rows, 2N] for B and C columns. Writes dzx[r*ldo + xoff + c] (dzx16: BF16 copy, may be
// null) and partials[(b*ntiles + tile), c*K + j] (weight) and [.., cd*K + c] (bias).
// Grid: ceil(batch * ntiles * cd / 256) blocks of 256.
extern "C" __global__ void fx_m2_conv_bwd(const float* __restrict__ zx, unsigned ld, unsigned xoff,
                                          const float* __restrict__ cw, const float* __restrict__ cb,
                                          const float* __restrict__ dxs, const float* __restrict__ dbc,
                                          float* __restrict__ dzx, unsigned ldo, __nv_bfloat16* __restrict__ dzx16,
                                          float* __restrict__ partials, unsigned batch, unsigned len, unsigned di,
                                          unsigned n, unsigned g, unsigned nh, unsigned k) {
    const unsigned gn = g * n, cd = di + 2 * gn;
    const unsigned ntiles = (len + M2_CONV_TILE - 1) / M2_CONV_TILE;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)batch * ntiles * cd) return;
    const unsigned c = (unsigned)(idx % cd);
    const unsigned bt = (unsigned)(idx / cd);
    const unsigned tile = bt % ntiles, b = bt / ntiles;
    const unsigned t0 = tile * M2_CONV_TILE, t1 = min(t0 + M2_CONV_TILE, len);
    const size_t rows = (size_t)batch * len, rbase = (size_t)b * len;
    const unsigned hpg = nh / g;

    // Right-aligned weights wa[i] = w[i - (MAX - k)] for the pre-activation over the input window
    // win[i] = input at step s - (MAX-1) + i; left-aligned wl[j] = w[j] for the input gradient over
    // the window dp[i] = pre-activation gradient at step s - (MAX-1) + i. Static register indices.
    float wa[M2_MAX_CONV], wl[M2_MAX_CONV], win[M2_MAX_CONV], dp[M2_MAX_CONV], dwa[M2_MAX_CONV];
#pragma unroll
    for (int i = 0; i < M2_MAX_CONV; ++i) {
        const int sh = i - (M2_MAX_CONV - (int)k);
        wa[i] = sh >= 0 ? cw[c * k + sh] : 0.0f;
        wl[i] = i < (int)k ? cw[c * k + i] : 0.0f;
        dp[i] = 0.0f;
        dwa[i] = 0.0f;
        const int s = (int)t0 - M2_MAX_CONV + i;  // the window ending at step t0 - 1
        win[i] = s >= 0 ? zx[(rbase + s) * ld + xoff + c] : 0.0f;
    }
    const float bias = cb[c];
    float db = 0.0f;
    // Where the conv output's gradient for this column comes from.
    const float* src;
    size_t sstride, hstride = 0;
    unsigned nheads_sum = 1;
    if (c < di) {
        src = dxs + c;
        sstride = di;
    } else {
        const unsigned within = c < di + gn ? c - di : c - di - gn;
        const unsigned off = c < di + gn ? 0 : n;
        const unsigned grp = within / n, kk = within % n;
        src = dbc + ((size_t)grp * hpg * rows) * 2 * n + off + kk;
        sstride = 2 * n;
        hstride = rows * 2 * n;
        nheads_sum = hpg;
    }
    const unsigned s_end = t1 + k - 1;  // exclusive: the halo finishes the tile's last input gradients
    for (unsigned s = t0; s < s_end; ++s) {
        float d = 0.0f;
        if (s < len) {
#pragma unroll
            for (int i = 0; i < M2_MAX_CONV - 1; ++i) win[i] = win[i + 1];
            win[M2_MAX_CONV - 1] = zx[(rbase + s) * ld + xoff + c];
            float pre = bias;
#pragma unroll
            for (int i = 0; i < M2_MAX_CONV; ++i) pre = fmaf(wa[i], win[i], pre);
            float dact = 0.0f;
            const float* p = src + (rbase + s) * sstride;
            for (unsigned hh = 0; hh < nheads_sum; ++hh) dact += p[hh * hstride];
            const float sg = m2_sigmoid(pre);
            d = dact * sg * (1.0f + pre * (1.0f - sg));
            if (s < t1) {
                db += d;
#pragma unroll
                for (int i = 0; i < M2_MAX_CONV; ++i) dwa[i] = fmaf(d, win[i], dwa[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < M2_MAX_CONV - 1; ++i) dp[i] = dp[i + 1];
        dp[M2_MAX_CONV - 1] = d;
        // the input at step t = s - (K-1) now has every pre-activation gradient it feeds
        if (s + 1 >= t0 + k) {
            const unsigned t = s + 1 - k;
            float v = 0.0f;
#pragma unroll
            for (int j = 0; j < M2_MAX_CONV; ++j) v = fmaf(wl[j], dp[M2_MAX_CONV - 1 - j], v);
            const size_t o = (rbase + t) * ldo + xoff + c;
            dzx[o] = v;
            if (dzx16) dzx16[o] = __float2bfloat16_rn(v);
        }
    }
    float* prow = partials + (size_t)(b * ntiles + tile) * cd * (k + 1);
#pragma unroll
    for (int i = 0; i < M2_MAX_CONV; ++i) {
        const int j = i - (M2_MAX_CONV - (int)k);
        if (j >= 0) prow[c * k + j] = dwa[i];
    }
    prow[cd * k + c] = db;
}

// Gated RMSNorm forward, one warp per (row, group of di/g columns): v = y * silu(z),
// rstd[r, grp] = 1/sqrt(mean(v^2) + eps), out = v * rstd * w (`out16`, may be null, its BF16
// copy); z at z[r*ldz + c]. Grid: ceil(rows * g / 8) blocks of 256.
extern "C" __global__ void fx_m2_gated_fwd(const float* __restrict__ y, const float* __restrict__ z, unsigned ldz,
                                           const float* __restrict__ w, float* __restrict__ out,
                                           __nv_bfloat16* __restrict__ out16, float* __restrict__ rstd,
                                           unsigned rows, unsigned di, unsigned g, float eps) {
    const unsigned unit = blockIdx.x * M2_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (unit >= rows * g) return;
    const unsigned row = unit / g, grp = unit % g, gs = di / g, c0 = grp * gs;
    const size_t oy = (size_t)row * di, oz = (size_t)row * ldz;
    float ss = 0.0f;
    for (unsigned c = c0 + lane; c < c0 + gs; c += 32) {
        const float v = y[oy + c] * m2_silu(z[oz + c]);
        ss = fmaf(v, v, ss);
    }
    ss = m2_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)gs + eps);
    if (lane == 0) rstd[unit] = r;
    for (unsigned c = c0 + lane; c < c0 + gs; c += 32) {
        const float o = y[oy + c] * m2_silu(z[oz + c]) * r * w[c];
        out[oy + c] = o;
        if (out16) out16[oy + c] = __float2bfloat16_rn(o);
    }
}

// Gated RMSNorm backward over blocks of 32 rows (a warp per (row, group)): s = silu(z),
// v = y * s, n = v * rstd, gg = dout * w, dv = rstd * (gg - n * mean(gg * n));
// dy = dv * s, dz[r*lddz + c] = dv * y * silu'(z) (dz16: BF16 copy, may be null),
// partials[block, c] = sum over the block's rows of dout * n.
// Grid: ceil(rows / 32) blocks of 256, dynamic shared memory 8 * di floats.
extern "C" __global__ void fx_m2_gated_bwd(const float* __restrict__ dout, const float* __restrict__ y,
                                           const float* __restrict__ z, unsigned ldz, const float* __restrict__ w,
                                           const float* __restrict__ rstd, float* __restrict__ dy,
                                           float* __restrict__ dz, unsigned lddz, __nv_bfloat16* __restrict__ dz16,
                                           float* __restrict__ partials, unsigned rows, unsigned di, unsigned g) {
    extern __shared__ float acc[];  // [M2_WARPS][di]
    const unsigned warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (unsigned e = threadIdx.x; e < M2_WARPS * di; e += M2_THREADS) acc[e] = 0.0f;
    __syncthreads();
    float* mine = acc + warp * di;
    const unsigned gs = di / g;
    for (unsigned u = warp; u < M2_ROWS_PER_BLOCK * g; u += M2_WARPS) {
        const unsigned row = blockIdx.x * M2_ROWS_PER_BLOCK + u / g, grp = u % g;
        if (row >= rows) break;  // rows grow with u: uniform per warp
        const size_t oy = (size_t)row * di, oz = (size_t)row * ldz, odz = (size_t)row * lddz;
        const float r = rstd[row * g + grp];
        const unsigned c0 = grp * gs;
        float s = 0.0f;
        for (unsigned c = c0 + lane; c < c0 + gs; c += 32) {
            const float n = y[oy + c] * m2_silu(z[oz + c]) * r;
            s = fmaf(dout[oy + c] * w[c], n, s);
        }
        s = m2_warp_sum(s) / (float)gs;
        for (unsigned c = c0 + lane; c < c0 + gs; c += 32) {
            const float zz = z[oz + c], yy = y[oy + c], dd = dout[oy + c];
            const float sg = m2_sigmoid(zz);
            const float si = m2_silu(zz);
            const float n = yy * si * r;
            const float dv = r * (dd * w[c] - n * s);
            dy[oy + c] = dv * si;
            const float dzv = dv * yy * sg * (1.0f + zz * (1.0f - sg));
            dz[odz + c] = dzv;
            if (dz16) dz16[odz + c] = __float2bfloat16_rn(dzv);
            mine[c] = fmaf(dd, n, mine[c]);
        }
    }
    __syncthreads();
    for (unsigned c = threadIdx.x; c < di; c += M2_THREADS) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < M2_WARPS; ++k) t += acc[k * di + c];
        partials[(size_t)blockIdx.x * di + c] = t;
    }
}

// norm_f, head and the MSE terms, one warp per row: u_f = rmsnorm(h) * w_norm (with rstd),
// pred = u_f . head_w + head_b, sq = (pred - target)^2, dpred = scale * (pred - target) with
// scale = 2 / rows. Grid: ceil(rows / 8) blocks of 256.
extern "C" __global__ void fx_m2_head_fwd(const float* __restrict__ h, const float* __restrict__ w_norm,
                                          const float* __restrict__ head_w, const float* __restrict__ head_b,
                                          const float* __restrict__ target, float* __restrict__ u_f,
                                          float* __restrict__ rstd, float* __restrict__ sq, float* __restrict__ dpred,
                                          unsigned rows, unsigned cols, float eps, float scale) {
    const unsigned row = blockIdx.x * M2_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const size_t o = (size_t)row * cols;
    float ss = 0.0f;
    for (unsigned c = lane; c < cols; c += 32) ss = fmaf(h[o + c], h[o + c], ss);
    ss = m2_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    float p = 0.0f;
    for (unsigned c = lane; c < cols; c += 32) {
        const float u = h[o + c] * r * w_norm[c];
        u_f[o + c] = u;
        p = fmaf(u, head_w[c], p);
    }
    p = m2_warp_sum(p) + head_b[0];
    if (lane == 0) {
        const float e = p - target[row];
        rstd[row] = r;
        sq[row] = e * e;
        dpred[row] = scale * e;
    }
}

// The loss mean(sq) and the head bias gradient sum(dpred), one block of 256 in a fixed order.
extern "C" __global__ void fx_m2_loss_reduce(const float* __restrict__ sq, const float* __restrict__ dpred,
                                             unsigned rows, float inv_rows, float* __restrict__ loss,
                                             float* __restrict__ dhead_b) {
    __shared__ float s1[M2_THREADS], s2[M2_THREADS];
    float a = 0.0f, b = 0.0f;
    for (unsigned i = threadIdx.x; i < rows; i += M2_THREADS) {
        a += sq[i];
        b += dpred[i];
    }
    s1[threadIdx.x] = a;
    s2[threadIdx.x] = b;
    __syncthreads();
    for (unsigned o = M2_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            s1[threadIdx.x] += s1[threadIdx.x + o];
            s2[threadIdx.x] += s2[threadIdx.x + o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        loss[0] = s1[0] * inv_rows;
        dhead_b[0] = s2[0];
    }
}
