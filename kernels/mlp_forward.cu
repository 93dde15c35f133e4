// Greedy action of a small policy MLP in one launch (crates/fx-kernels/src/cuda/mlp.rs; the
// f64 reference is crates/fx-kernels/src/mlp_ref.rs). One thread block per input row
// (grid-stride when the batch exceeds the grid); the row's activations live in shared memory
// from layer to layer. Within a layer each warp owns G output neurons at a time: its lanes
// stride along the G weight rows (PyTorch layout [out, in], so a warp's reads of one row are
// coalesced), all G·(in/128) float4 loads in flight before any reduction, then G shuffle
// reductions. At batch 1 one SM pulls the whole network (~0.45 MB) from L2 on every call, so
// keeping many loads in flight is what sets the latency.
//
// Head LOGITS: scores = W_head z + b_head. Head DUELING: Q = (A - mean A) + V with V
// (1 row) and A (n_actions rows) computed as one (1 + n_actions)-wide layer. The action is
// the first maximal score (strict >, as candle's and torch's argmax).

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

// y[n] = act(x · W[n] + b[n]) for n < out, where rows n < split come from (w0, b0) and the
// rest from (w1, b1) at n - split. x and y are shared memory (16-byte aligned).
template <int G>
__device__ void fx_dense(const float* __restrict__ w0, const float* __restrict__ b0, unsigned int split,
                         const float* __restrict__ w1, const float* __restrict__ b1, const float* x, float* y,
                         unsigned int in, unsigned int out, unsigned int act, bool vec4) {
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (unsigned int base = warp * G; base < out; base += n_warps * G) {
        // Lane g fetches neuron base + g's bias now, so its latency hides behind the row loads.
        float bias = 0.f;
        if (lane < G && base + lane < out) bias = base + lane < split ? b0[base + lane] : b1[base + lane - split];
        const float* rows[G];
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            // Past the last neuron a lane re-reads the last row (valid memory); never written.
            unsigned int n = min(base + g, out - 1);
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
        // The xor reduction leaves every sum in every lane: lane g writes neuron base + g.
        float mine = 0.f;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float sum = fx_warp_sum(acc[g]);
            if (lane == (unsigned int)g) mine = sum;
        }
        if (lane < G && base + lane < out) y[base + lane] = fx_activate(mine + bias, act);
    }
}

// Neurons per warp pass: enough that one pass covers the layer when it can (fewer, longer
// passes keep more loads in flight), at most 8 (register budget at 512 threads).
__device__ void fx_layer(const float* w0, const float* b0, unsigned int split, const float* w1, const float* b1,
                         const float* x, float* y, unsigned int in, unsigned int out, unsigned int act, bool vec4) {
    const unsigned int per_warp = (out + (blockDim.x >> 5) - 1) / (blockDim.x >> 5);
    if (per_warp <= 1) fx_dense<1>(w0, b0, split, w1, b1, x, y, in, out, act, vec4);
    else if (per_warp <= 2) fx_dense<2>(w0, b0, split, w1, b1, x, y, in, out, act, vec4);
    else if (per_warp <= 4) fx_dense<4>(w0, b0, split, w1, b1, x, y, in, out, act, vec4);
    else fx_dense<8>(w0, b0, split, w1, b1, x, y, in, out, act, vec4);
}

// The greedy action of the row already in buf[0] (shared memory), every thread of the block
// taking part; the scores go to `values` (n_actions floats, or null). Returns the action in
// thread 0 (other threads: unspecified). Ends with a __syncthreads: buf and scores are free.
__device__ unsigned int fx_greedy_row(const FxMlpParams& p, float (*buf)[FX_MLP_MAX_WIDTH], float* scores,
                                      float* __restrict__ values) {
    const unsigned int a_n = p.n_actions, nh = p.n_hidden;
    unsigned int cur = 0;
    for (unsigned int l = 0; l < nh; ++l) {
        fx_layer(p.w[l], p.b[l], p.width[l + 1], p.w[l], p.b[l], buf[cur], buf[cur ^ 1u], p.width[l], p.width[l + 1],
                 p.act[l], (p.vec4_mask >> l) & 1u);
        cur ^= 1u;
        __syncthreads();
    }
    const bool v4 = (p.vec4_mask >> nh) & 1u;
    if (p.head == FX_HEAD_DUELING)
        fx_layer(p.w[nh], p.b[nh], 1u, p.w[nh + 1], p.b[nh + 1], buf[cur], scores, p.width[nh], a_n + 1u,
                 FX_ACT_IDENTITY, v4);
    else
        fx_layer(p.w[nh], p.b[nh], a_n, p.w[nh], p.b[nh], buf[cur], scores, p.width[nh], a_n, FX_ACT_IDENTITY, v4);
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
    __syncthreads();  // the next row reuses buf and scores
    return best;
}

// obs [batch, width[0]] f32 row-major; actions [batch] u32; values [batch, n_actions] f32 or
// null. Block size: a multiple of 32, at most 512.
extern "C" __global__ void __launch_bounds__(512, 1) fx_mlp_greedy(const FxMlpParams p, const float* __restrict__ obs,
                                                                unsigned int batch, unsigned int* __restrict__ actions,
                                                                float* __restrict__ values) {
    __shared__ __align__(16) float buf[2][FX_MLP_MAX_WIDTH];
    __shared__ float scores[FX_MLP_MAX_ACTIONS + 1];
    for (unsigned int row = blockIdx.x; row < batch; row += gridDim.x) {
        const float* x = obs + (size_t)row * p.width[0];
        for (unsigned int k = threadIdx.x; k < p.width[0]; k += blockDim.x) buf[0][k] = x[k];
        __syncthreads();
        const unsigned int a = fx_greedy_row(p, buf, scores, values ? values + (size_t)row * p.n_actions : nullptr);
        if (threadIdx.x == 0) actions[row] = a;
    }
}

// A persistent decision server: one block that stays resident and answers requests posted
// in page-locked host memory mapped into the device (no launch, no stream sync per
// decision). The host writes the observation into `obs`, then a new sequence number into
// ctrl[0]; the block sees it (polling over the bus), computes the greedy action, writes it
// to reply[0] and then the sequence number to reply[1], which the host polls. ctrl[1] != 0
// stops the kernel. `first` is the sequence number of the last request already answered.
// The weights must not change while it runs (the host passes a private snapshot): a
// resident kernel keeps cached lines across requests.
__device__ __forceinline__ unsigned int fx_load_sys(const unsigned int* a) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
    return v;
}

extern "C" __global__ void __launch_bounds__(512, 1) fx_mlp_serve(const FxMlpParams p, const volatile float* obs,
                                                               const unsigned int* ctrl, volatile unsigned int* reply,
                                                               unsigned int first) {
    __shared__ __align__(16) float buf[2][FX_MLP_MAX_WIDTH];
    __shared__ float scores[FX_MLP_MAX_ACTIONS + 1];
    __shared__ unsigned int s_seq, s_stop;
    unsigned int last = first;
    for (;;) {
        if (threadIdx.x == 0) {
            unsigned int seq, stop;
            do {
                seq = fx_load_sys(ctrl);
                stop = fx_load_sys(ctrl + 1);
            } while (seq == last && stop == 0u);
            s_seq = seq;
            s_stop = stop;
        }
        __syncthreads();
        if (s_stop != 0u) return;
        const unsigned int seq = s_seq;
        // The acquire load of ctrl[0] orders these reads after the host's observation writes.
        for (unsigned int k = threadIdx.x; k < p.width[0]; k += blockDim.x) buf[0][k] = obs[k];
        __syncthreads();
        const unsigned int a = fx_greedy_row(p, buf, scores, nullptr);
        if (threadIdx.x == 0) {
            reply[0] = a;
            __threadfence_system();  // the action is visible before the sequence number
            reply[1] = seq;
        }
        last = seq;
    }
}
