// The fused greedy policy MLP shared by mlp_forward.cu (a block per row, any arch) and
// mlp_cluster.cu (a thread-block cluster per row, Hopper+): the parameter block, the dense
// layer over a range of output neurons, and the head with its argmax. The f64 reference is
// crates/fx-models/src/mlp/reference.rs; the launch wrappers are crates/fx-models/src/mlp/cuda.rs.
//
// Within a layer each warp owns G output neurons at a time: its lanes stride along the G
// weight rows (PyTorch layout [out, in], so a warp's reads of one row are coalesced), all
// G·(in/128) float4 loads in flight before any reduction, then G shuffle reductions. At
// batch 1 the whole network (~0.45 MB) comes from L2 on every call, so keeping many loads
// in flight is what sets the latency.
//
// Head LOGITS: scores = W_head z + b_head. Head DUELING: Q = (A - mean A) + V with V
// (1 row) and A (n_actions rows) computed as one (1 + n_actions)-wide layer. The action is
// the first maximal score (strict >, as candle's and torch's argmax).
#pragma once

#define FX_MLP_MAX_WIDTH 1024
#define FX_MLP_MAX_HIDDEN 4
#define FX_MLP_MAX_ACTIONS 16

#define FX_ACT_IDENTITY 0u
#define FX_ACT_RELU 1u
#define FX_ACT_TANH 2u
#define FX_HEAD_LOGITS 0u
#define FX_HEAD_DUELING 1u

// Mirrors `MlpParams` in mlp.rs field for field (152 bytes, passed by value).
struct FxMlpParams {
    // Hidden layers 0..n_hidden-1, then the head: logits at [n_hidden]; dueling value at
    // [n_hidden] and advantage at [n_hidden + 1].
    const float* w[FX_MLP_MAX_HIDDEN + 2];
    const float* b[FX_MLP_MAX_HIDDEN + 2];
    unsigned int width[FX_MLP_MAX_HIDDEN + 1];  // input width, then each hidden layer's width
    unsigned int act[FX_MLP_MAX_HIDDEN];
    unsigned int n_hidden;
    unsigned int n_actions;
    unsigned int head;
    unsigned int vec4_mask;  // bit l: layer l's rows may be read as float4 (in % 4 == 0, 16-byte aligned)
};
static_assert(sizeof(FxMlpParams) == 152, "FxMlpParams must match MlpParams in mlp.rs");

__device__ __forceinline__ float fx_activate(float x, unsigned int act) {
    if (act == FX_ACT_RELU) return x < 0.f ? 0.f : x;  // NaN stays NaN, as torch.relu
    if (act == FX_ACT_TANH) return tanhf(x);
    return x;
}

__device__ __forceinline__ float fx_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Stores a neuron's output into this block's shared buffer.
struct FxLocalStore {
    float* y;
    __device__ __forceinline__ void operator()(unsigned int n, float v) const { y[n] = v; }
};

// act(x · W[n] + b[n]) for lo <= n < hi, handed to store(n, value), where rows n < split come
// from (w0, b0) and the rest from (w1, b1) at n - split. x is shared memory (16-byte aligned).
template <int G, class Store>
__device__ void fx_dense(const float* __restrict__ w0, const float* __restrict__ b0, unsigned int split,
                         const float* __restrict__ w1, const float* __restrict__ b1, const float* x, Store store,
                         unsigned int in, unsigned int lo, unsigned int hi, unsigned int act, bool vec4) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (unsigned int base = lo + warp * G; base < hi; base += n_warps * G) {
        // Lane g fetches neuron base + g's bias now, so its latency hides behind the row loads.
        float bias = 0.f;
        if (lane < G && base + lane < hi) bias = base + lane < split ? b0[base + lane] : b1[base + lane - split];
        const float* rows[G];
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            // Past the last neuron a lane re-reads the last row (valid memory); never stored.
            unsigned int n = min(base + g, hi - 1);
            rows[g] = n < split ? w0 + (size_t)n * in : w1 + (size_t)(n - split) * in;
            acc[g] = 0.f;
        }
        if (vec4) {
            const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 2
            for (unsigned int k = lane; k < (in >> 2); k += 32) {
                float4 w[G];
#pragma unroll
                for (int g = 0; g < G; ++g) w[g] = __ldg(reinterpret_cast<const float4*>(rows[g]) + k);
                const float4 xv = x4[k];
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    acc[g] = fmaf(w[g].x, xv.x, acc[g]);
                    acc[g] = fmaf(w[g].y, xv.y, acc[g]);
                    acc[g] = fmaf(w[g].z, xv.z, acc[g]);
                    acc[g] = fmaf(w[g].w, xv.w, acc[g]);
                }
            }
        } else {
#pragma unroll 2
            for (unsigned int k = lane; k < in; k += 32) {
                float w[G];
#pragma unroll
                for (int g = 0; g < G; ++g) w[g] = __ldg(rows[g] + k);
                const float xv = x[k];
#pragma unroll
                for (int g = 0; g < G; ++g) acc[g] = fmaf(w[g], xv, acc[g]);
            }
        }
        // The xor reduction leaves every sum in every lane: lane g stores neuron base + g.
        float mine = 0.f;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float sum = fx_warp_sum(acc[g]);
            if (lane == (unsigned int)g) mine = sum;
        }
        if (lane < G && base + lane < hi) store(base + lane, fx_activate(mine + bias, act));
    }
}

// Neurons per warp pass: enough that one pass covers the range when it can (fewer, longer
// passes keep more loads in flight), at most 8 (register budget at 512 threads).
template <class Store>
__device__ void fx_layer(const float* w0, const float* b0, unsigned int split, const float* w1, const float* b1,
                         const float* x, Store store, unsigned int in, unsigned int lo, unsigned int hi,
                         unsigned int act, bool vec4) {
    if (hi <= lo) return;
    const unsigned int per_warp = (hi - lo + (blockDim.x >> 5) - 1) / (blockDim.x >> 5);
    if (per_warp <= 1) fx_dense<1>(w0, b0, split, w1, b1, x, store, in, lo, hi, act, vec4);
    else if (per_warp <= 2) fx_dense<2>(w0, b0, split, w1, b1, x, store, in, lo, hi, act, vec4);
    else if (per_warp <= 4) fx_dense<4>(w0, b0, split, w1, b1, x, store, in, lo, hi, act, vec4);
    else fx_dense<8>(w0, b0, split, w1, b1, x, store, in, lo, hi, act, vec4);
}

// The head over the last hidden activations z (shared memory) into `scores`, then the first
// maximal score's index, in thread 0 (other threads: unspecified); the scores go to `values`
// (n_actions floats) when it is not null. Every thread of the block takes part; ends with a
// __syncthreads, so z and scores are free again.
__device__ unsigned int fx_head_argmax(const FxMlpParams& p, const float* z, float* scores, float* __restrict__ values) {
    const unsigned int a_n = p.n_actions, nh = p.n_hidden;
    const bool v4 = (p.vec4_mask >> nh) & 1u;
    if (p.head == FX_HEAD_DUELING)
        fx_layer(p.w[nh], p.b[nh], 1u, p.w[nh + 1], p.b[nh + 1], z, FxLocalStore{scores}, p.width[nh], 0u, a_n + 1u,
                 FX_ACT_IDENTITY, v4);
    else
        fx_layer(p.w[nh], p.b[nh], a_n, p.w[nh], p.b[nh], z, FxLocalStore{scores}, p.width[nh], 0u, a_n,
                 FX_ACT_IDENTITY, v4);
    __syncthreads();
    unsigned int best = 0;
    if (threadIdx.x == 0) {
        // Dueling: the order of candle's forward, (A - mean A) + V.
        const float* s = p.head == FX_HEAD_DUELING ? scores + 1 : scores;
        float mean = 0.f;
        if (p.head == FX_HEAD_DUELING) {
            for (unsigned int j = 0; j < a_n; ++j) mean += s[j];
            mean *= 1.f / (float)a_n;  // candle divides by n as a multiply by 1/n
        }
        float best_q = 0.f;
        for (unsigned int j = 0; j < a_n; ++j) {
            const float q = p.head == FX_HEAD_DUELING ? (s[j] - mean) + scores[0] : s[j];
            if (values) values[j] = q;
            if (j == 0 || q > best_q) {
                best = j;
                best_q = q;
            }
        }
    }
    __syncthreads();  // the next row reuses the buffers and scores
    return best;
}

__device__ __forceinline__ unsigned int fx_load_sys(const unsigned int* a) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
    return v;
}

// The servers' wait for the next request (one thread): polls ctrl[0] (the request's sequence
// number) and ctrl[1] (stop) over the bus until ctrl[0] moves past `last` or stop is set.
// The acquire loads order what the thread reads next after the host's writes before them.
__device__ __forceinline__ void fx_poll_request(const unsigned int* ctrl, unsigned int last, unsigned int* seq,
                                                unsigned int* stop) {
    do {
        *seq = fx_load_sys(ctrl);
        *stop = fx_load_sys(ctrl + 1);
    } while (*seq == last && *stop == 0u);
}
