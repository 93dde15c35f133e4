// The greedy action of an INT8 policy MLP (fx-quant's QuantNet: a DQN or a PPO actor) in one
// launch. The launch wrapper is crates/fx-models/src/mlp/cuda.rs (an `MlpPolicy` built with
// `new_int8`), the host-side layout and packing crates/fx-models/src/mlp/int8.rs. What it
// computes is fx_quant::reference::reference_scores, bit for bit: the device tests in
// crates/fx-quant/src/gpu_policy.rs compare every score's bits on fresh random networks.
//
// Every rounding step is the CPU reference's, written with the _rn intrinsics so that nvcc
// cannot contract a multiply and an add into an FMA:
//   INT8 layer: step = dynamic ? (max|x| > 0 ? max|x| / 127 : 1) : the stored input scale;
//               xq = clamp(rint(x * (1 / step)), ±127); acc = Σ wq · xq (exact int32, any
//               order); y = float(acc) * (w_scale[o] * step) + bias[o];
//   F32 layer:  y = (((0 + w0·x0) + w1·x1) + ...) + bias[o], in input order;
//   hidden:     ReLU max(y, 0), or fx-quant's rational tanh (activation.rs);
//   dueling:    Q = (A − (Σ A, left to right) / n) + V; the action is the first maximal score.
//
// A block (512 threads for one or two rows, else 256) takes R rows (1, 2, 4 or 8, chosen by
// the host: fewer rows per block when the batch would not fill the GPU) through every layer,
// their activations in shared memory; each layer's epilogue gathers the rows' max |output|
// for the next layer's dynamic step (shared-memory atomics on float bits), so a layer is
// two barriers: quantise, then products. Products:
// four outputs per thread group of L lanes (L = 8 for the default's 256-wide layers, up to 32
// for the head's few outputs), each lane a strided share of the input's 4-byte words, one
// 16-byte load for the four outputs, dp4a into 4 × R int32 accumulators, so each weight word
// loaded serves all R rows. Weights are stored input-major ([in/4][out] words, `out` padded
// to a multiple of 4; F32 layers [in][out]) so that a warp's loads are whole 128-byte lines.

#include "fx_int8.cuh"

#define FX_I8_MAX_LAYERS 6
#define FX_I8_MAX_HIDDEN 4
#define FX_I8_MAX_ACTIONS 16

#define FX_I8_ACT_RELU 1u
#define FX_I8_ACT_TANH 2u
#define FX_I8_HEAD_LOGITS 0u
#define FX_I8_HEAD_DUELING 1u

// Mirrors `MlpI8Params` in crates/fx-models/src/mlp/int8.rs field for field (256 bytes).
struct FxMlpI8Params {
    // Layers 0..n_hidden-1, then the head: logits at [n_hidden]; dueling value at [n_hidden]
    // and advantage at [n_hidden + 1]. INT8 layers: int8 words [ceil(in/4)][ceil(out/4)*4],
    // 16-byte aligned; F32 layers: float [in][out] (cast).
    const unsigned int* w[FX_I8_MAX_LAYERS];
    const float* w_scale[FX_I8_MAX_LAYERS];  // INT8 layers: [out]
    const float* b[FX_I8_MAX_LAYERS];
    float in_scale[FX_I8_MAX_LAYERS];        // INT8 layers: the stored step; 0: each row's own
    unsigned int in_width[FX_I8_MAX_LAYERS];
    unsigned int out_width[FX_I8_MAX_LAYERS];
    unsigned int act[FX_I8_MAX_HIDDEN];
    unsigned int int8_mask;  // bit l: layer l is INT8
    unsigned int n_hidden;
    unsigned int n_actions;
    unsigned int head;
    unsigned int rows;    // R: rows per block
    unsigned int stride;  // floats per row of the activation buffers (a multiple of 4)
};
static_assert(sizeof(FxMlpI8Params) == 256, "FxMlpI8Params must match MlpI8Params in mlp_i8.rs");

// fx_quant::activation::tanh_rational, operation for operation.
__device__ __forceinline__ float fx_i8_tanh(float x) {
    const float CLAMP = 7.905311f;
    const float A1 = 4.8935246e-3f, A3 = 6.3726193e-4f, A5 = 1.4857224e-5f, A7 = 5.122297e-8f;
    const float A9 = -8.604672e-11f, A11 = 2.000188e-13f, A13 = -2.7607685e-16f;
    const float B0 = 4.8935252e-3f, B2 = 2.2684346e-3f, B4 = 1.1853471e-4f, B6 = 1.1982584e-6f;
    x = fminf(fmaxf(x, -CLAMP), CLAMP);
    const float x2 = __fmul_rn(x, x);
    float p = __fadd_rn(__fmul_rn(x2, A13), A11);
    p = __fadd_rn(__fmul_rn(x2, p), A9);
    p = __fadd_rn(__fmul_rn(x2, p), A7);
    p = __fadd_rn(__fmul_rn(x2, p), A5);
    p = __fadd_rn(__fmul_rn(x2, p), A3);
    p = __fadd_rn(__fmul_rn(x2, p), A1);
    float q = __fadd_rn(__fmul_rn(x2, B6), B4);
    q = __fadd_rn(__fmul_rn(x2, q), B2);
    q = __fadd_rn(__fmul_rn(x2, q), B0);
    return __fdiv_rn(__fmul_rn(x, p), q);
}

__device__ __forceinline__ float fx_i8_act(float y, unsigned int act) {
    if (act == FX_I8_ACT_RELU) return fmaxf(y, 0.f);
    if (act == FX_I8_ACT_TANH) return fx_i8_tanh(y);
    return y;
}


// Where a layer's outputs go: row r, output o at y[r * row_stride + col + o]; with `amax`,
// each row's max |output| (as float bits: non-negative floats order as their bits) is
// gathered there for the next layer's dynamic step.
struct FxI8Out {
    float* y;
    unsigned int row_stride;
    unsigned int col;
    unsigned int act;      // 0: none (head)
    unsigned int* amax;    // [R] or null
};

// max(m, |v|) on float bits, NaN skipped (the reference's max ignores a NaN).
__device__ __forceinline__ unsigned int fx_i8_absmax(unsigned int m, float v) {
    const unsigned int b = __float_as_uint(fabsf(v));
    return isnan(v) ? m : max(m, b);
}

// Folds each lane's per-row maxima over the warp and into out.amax (one shared-memory atomic
// per warp and row). Every thread of the block calls it, outside any divergent branch.
template <int R>
__device__ __forceinline__ void fx_i8_publish_amax(const FxI8Out& out, unsigned int (&m)[R], unsigned int nr) {
    if (!out.amax) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        unsigned int v = m[r];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
        if ((threadIdx.x & 31u) == 0 && (unsigned int)r < nr) atomicMax(out.amax + r, v);
    }
}

// One layer for the block's rows: x [R][stride] floats in (amax_in: the rows' max |x| as
// float bits), outputs to `out`. Every thread of the block calls it; two barriers: after the
// input is quantised, and at the end (outputs and out.amax complete).
// LOADS: 16-byte weight loads a lane has in flight before it uses them.
template <int R, int LOADS>
__device__ void fx_i8_layer(const FxMlpI8Params& p, unsigned int l, const float* x, const unsigned int* amax_in,
                            unsigned int* xq, float* step, unsigned int nr, FxI8Out out) {
    const unsigned int in = p.in_width[l], n_out = p.out_width[l], k4n = (in + 3u) >> 2;
    const unsigned int tid = threadIdx.x, lane = tid & 31u;
    const unsigned int xs = p.stride >> 2;
    // The next layer's maxima start from zero: nothing reads out.amax before the barrier
    // below, and its last reader (this block's previous layer but one) is two barriers back.
    if (out.amax && tid < (unsigned int)R) out.amax[tid] = 0u;
    unsigned int m[R];
#pragma unroll
    for (int r = 0; r < R; ++r) m[r] = 0u;
    if ((p.int8_mask >> l) & 1u) {
        // Each row's step (the stored one, or max |x| / 127 from the previous layer's
        // maxima), then the input quantised into words of four bytes, zero past `in`.
        for (unsigned int i = tid; i < nr * k4n; i += blockDim.x) {
            const unsigned int r = i / k4n, k = (i - r * k4n) * 4u;
            float st = p.in_scale[l];
            if (st == 0.f) {
                const float mx = __uint_as_float(amax_in[r]);
                st = mx > 0.f ? __fdiv_rn(mx, 127.0f) : 1.0f;
            }
            if (k == 0) step[r] = st;
            const float inv = __fdiv_rn(1.0f, st);
            const float* xr = x + r * p.stride;
            unsigned int w = 0;
#pragma unroll
            for (unsigned int j = 0; j < 4u; ++j)
                if (k + j < in) w |= ((unsigned int)fx_q8(xr[k + j], inv) & 0xffu) << (8u * j);
            xq[r * xs + (k >> 2)] = w;
        }
        __syncthreads();
        // Outputs in quads (the image pads `out` to a multiple of 4): a lane loads 16 bytes,
        // one input word of four consecutive outputs. Lanes per quad: as many as keep every
        // thread busy, at most a warp; each lane issues up to FX_I8_LOADS loads before it
        // uses any, so 512 threads can issue a whole 256 × 256 layer (64 KB) before waiting:
        // a batch-1 decision is bound by load latency, not bandwidth (the measured gain over
        // one 4-byte load per thread and step is in docs/perf/). The quad's scales and biases
        // are loaded with the weights, not after the sums.
        const unsigned int nq = (n_out + 3u) >> 2;
        unsigned int L = 1;
        while (L < 32u && nq * L * 2u <= blockDim.x) L <<= 1;
        const unsigned int part = tid & (L - 1u), group = tid / L, groups = blockDim.x / L;
        const unsigned int gmask = (L == 32u ? 0xffffffffu : ((1u << L) - 1u) << (lane & ~(L - 1u)));
        const uint4* w4 = reinterpret_cast<const uint4*>(p.w[l]);
        // Every lane of a group runs the same trip count (q is the group's), so the group's
        // shuffles below see all its lanes.
        for (unsigned int q = group; q < nq; q += groups) {
            float ws[4], bias[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const unsigned int o = min(4u * q + c, n_out - 1u);  // past the end: never stored
                ws[c] = __ldg(p.w_scale[l] + o);
                bias[c] = __ldg(p.b[l] + o);
            }
            int acc[4][R];
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[c][r] = 0;
            for (unsigned int k0 = part; k0 < k4n; k0 += LOADS * L) {
                uint4 wv[LOADS];
#pragma unroll
                for (int j = 0; j < LOADS; ++j) {
                    const unsigned int k = k0 + j * L;
                    wv[j] = k < k4n ? __ldg(w4 + (size_t)k * nq + q) : make_uint4(0u, 0u, 0u, 0u);
                }
#pragma unroll
                for (int j = 0; j < LOADS; ++j) {
                    const unsigned int k = k0 + j * L;
                    if (k < k4n) {
#pragma unroll
                        for (int r = 0; r < R; ++r) {
                            const int xv = (int)xq[r * xs + k];
                            acc[0][r] = __dp4a((int)wv[j].x, xv, acc[0][r]);
                            acc[1][r] = __dp4a((int)wv[j].y, xv, acc[1][r]);
                            acc[2][r] = __dp4a((int)wv[j].z, xv, acc[2][r]);
                            acc[3][r] = __dp4a((int)wv[j].w, xv, acc[3][r]);
                        }
                    }
                }
            }
            for (unsigned int d = L >> 1; d > 0; d >>= 1)
#pragma unroll
                for (int c = 0; c < 4; ++c)
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[c][r] += __shfl_xor_sync(gmask, acc[c][r], d);
            if (part == 0) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const unsigned int o = 4u * q + c;
                    if (o < n_out) {
#pragma unroll
                        for (int r = 0; r < R; ++r)
                            if ((unsigned int)r < nr) {
                                const float y = fx_dq8(acc[c][r], ws[c], step[r], bias[c]);
                                const float a = fx_i8_act(y, out.act);
                                out.y[r * out.row_stride + out.col + o] = a;
                                m[r] = fx_i8_absmax(m[r], a);
                            }
                    }
                }
            }
        }
    } else {
        __syncthreads();  // the same barriers as an INT8 layer (out.amax zeroed before use)
        // An F32 layer: each output summed in input order by one thread (the reference's
        // order), so a few such layers cost more than INT8 ones.
        const float* w = reinterpret_cast<const float*>(p.w[l]);
        for (unsigned int o = tid; o < n_out; o += blockDim.x) {
            const float bias = __ldg(p.b[l] + o);
            float acc[R];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = 0.f;
            for (unsigned int k = 0; k < in; ++k) {
                const float wv = __ldg(w + (size_t)k * n_out + o);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = __fadd_rn(acc[r], __fmul_rn(wv, x[r * p.stride + k]));
            }
#pragma unroll
            for (int r = 0; r < R; ++r)
                if ((unsigned int)r < nr) {
                    const float a = fx_i8_act(__fadd_rn(acc[r], bias), out.act);
                    out.y[r * out.row_stride + out.col + o] = a;
                    m[r] = fx_i8_absmax(m[r], a);
                }
        }
    }
    fx_i8_publish_amax<R>(out, m, nr);
    __syncthreads();
}

// Dynamic shared memory: x and y [R][stride] floats, xq [R][stride / 4] words, step [R],
// scores [R][n_actions + 1], and two [R] arrays of row maxima (the current input's, the
// next one's).
template <int R, int LOADS>
__device__ void fx_i8_greedy(const FxMlpI8Params& p, const float* __restrict__ obs, unsigned int batch,
                             unsigned int* __restrict__ actions, float* __restrict__ values) {
    extern __shared__ __align__(16) float fx_i8_smem[];
    float* buf0 = fx_i8_smem;
    float* buf1 = buf0 + R * p.stride;
    unsigned int* xq = reinterpret_cast<unsigned int*>(buf1 + R * p.stride);
    float* step = reinterpret_cast<float*>(xq + R * (p.stride >> 2));
    float* scores = step + R;
    const unsigned int na = p.n_actions, sc_stride = na + 1u, nh = p.n_hidden, in0 = p.in_width[0];
    unsigned int* amax_a = reinterpret_cast<unsigned int*>(scores + R * sc_stride);
    unsigned int* amax_b = amax_a + R;
    for (unsigned int row0 = blockIdx.x * R; row0 < batch; row0 += gridDim.x * R) {
        const unsigned int nr = min((unsigned int)R, batch - row0);
        if (threadIdx.x < (unsigned int)R) amax_a[threadIdx.x] = 0u;
        __syncthreads();  // (also: the previous rows' last reads of amax_a are done)
        unsigned int m[R];
#pragma unroll
        for (int r = 0; r < R; ++r) m[r] = 0u;
        for (unsigned int i = threadIdx.x; i < nr * in0; i += blockDim.x) {
            const unsigned int r = i / in0, k = i - r * in0;
            const float v = obs[(size_t)(row0 + r) * in0 + k];
            buf0[r * p.stride + k] = v;
            // r is not a compile-time index here: fold into the right slot.
#pragma unroll
            for (int rr = 0; rr < R; ++rr)
                if ((unsigned int)rr == r) m[rr] = fx_i8_absmax(m[rr], v);
        }
        fx_i8_publish_amax<R>(FxI8Out{nullptr, 0u, 0u, 0u, amax_a}, m, nr);
        __syncthreads();
        float* x = buf0;
        float* y = buf1;
        unsigned int* amax_in = amax_a;
        unsigned int* amax_out = amax_b;
        for (unsigned int l = 0; l < nh; ++l) {
            fx_i8_layer<R, LOADS>(p, l, x, amax_in, xq, step, nr, FxI8Out{y, p.stride, 0u, p.act[l], amax_out});
            float* t = x;
            x = y;
            y = t;
            unsigned int* u = amax_in;
            amax_in = amax_out;
            amax_out = u;
        }
        if (p.head == FX_I8_HEAD_DUELING) {
            fx_i8_layer<R, LOADS>(p, nh, x, amax_in, xq, step, nr, FxI8Out{scores, sc_stride, 0u, 0u, nullptr});
            fx_i8_layer<R, LOADS>(p, nh + 1u, x, amax_in, xq, step, nr, FxI8Out{scores, sc_stride, 1u, 0u, nullptr});
        } else {
            fx_i8_layer<R, LOADS>(p, nh, x, amax_in, xq, step, nr, FxI8Out{scores, sc_stride, 0u, 0u, nullptr});
        }
        if (threadIdx.x < nr) {
            const unsigned int r = threadIdx.x;
            const float* s = scores + r * sc_stride;
            float* v = values ? values + (size_t)(row0 + r) * na : nullptr;
            float mean = 0.f;
            if (p.head == FX_I8_HEAD_DUELING) {
                float sum = -0.0f;  // Rust's f32 `Sum` starts from -0.0
                for (unsigned int j = 0; j < na; ++j) sum = __fadd_rn(sum, s[1u + j]);
                mean = __fdiv_rn(sum, (float)na);
            }
            unsigned int best = 0;
            float best_q = 0.f;
            for (unsigned int j = 0; j < na; ++j) {
                const float q = p.head == FX_I8_HEAD_DUELING ? __fadd_rn(__fsub_rn(s[1u + j], mean), s[0]) : s[j];
                if (v) v[j] = q;
                if (j == 0 || q > best_q) {
                    best = j;
                    best_q = q;
                }
            }
            actions[row0 + r] = best;
        }
        __syncthreads();  // the next rows reuse every buffer
    }
}

// obs [batch, in_width[0]] f32 row-major; actions [batch] u32; values [batch, n_actions] f32
// or null; dynamic shared memory as fx_i8_greedy says (mlp_i8.rs computes it); grid:
// ceil(batch / rows) blocks at most (grid-stride beyond). Two entry points, so that each gets
// its own register budget: this one for 1 or 2 rows a block (512 threads: a lone block has
// eight loads a lane in flight), fx_mlp_i8_greedy_wide for 4 or 8 (256 threads, several
// blocks an SM for large batches; fewer loads in flight and accumulators that fit in the
// registers of FX_I8_WIDE_BLOCKS blocks). Threads: mlp_i8.rs, block_threads; the entry for a
// launch: cuda/mlp.rs.
extern "C" __global__ void __launch_bounds__(512) fx_mlp_i8_greedy(const FxMlpI8Params p,
                                                                const float* __restrict__ obs, unsigned int batch,
                                                                unsigned int* __restrict__ actions,
                                                                float* __restrict__ values) {
    if (p.rows == 1) fx_i8_greedy<1, 8>(p, obs, batch, actions, values);
    else fx_i8_greedy<2, 8>(p, obs, batch, actions, values);
}

#ifndef FX_I8_WIDE_BLOCKS
#define FX_I8_WIDE_BLOCKS 3
#endif
#ifndef FX_I8_WIDE_LOADS
#define FX_I8_WIDE_LOADS 2
#endif
extern "C" __global__ void __launch_bounds__(256, FX_I8_WIDE_BLOCKS) fx_mlp_i8_greedy_wide(
    const FxMlpI8Params p, const float* __restrict__ obs, unsigned int batch, unsigned int* __restrict__ actions,
    float* __restrict__ values) {
    if (p.rows == 4) fx_i8_greedy<4, FX_I8_WIDE_LOADS>(p, obs, batch, actions, values);
    else fx_i8_greedy<8, FX_I8_WIDE_LOADS>(p, obs, batch, actions, values);
}
