// Greedy action of a small policy MLP in one launch (crates/fx-models/src/mlp/cuda.rs; the
// f64 reference is crates/fx-models/src/mlp/reference.rs). One thread block per input row
// (grid-stride when the batch exceeds the grid); the row's activations live in shared memory
// from layer to layer. The layer and head code is fx_mlp.cuh's, shared with the cluster
// kernels of mlp_cluster.cu (Hopper+), which spread one row over several SMs.
#include "fx_mlp.cuh"

// The greedy action of the row already in buf[0] (shared memory), every thread of the block
// taking part; the scores go to `values` (n_actions floats, or null). Returns the action in
// thread 0 (other threads: unspecified). Ends with a __syncthreads: buf and scores are free.
__device__ unsigned int fx_greedy_row(const FxMlpParams& p, float (*buf)[FX_MLP_MAX_WIDTH], float* scores,
                                      float* __restrict__ values) {
    unsigned int cur = 0;
    for (unsigned int l = 0; l < p.n_hidden; ++l) {
        fx_layer(p.w[l], p.b[l], p.width[l + 1], p.w[l], p.b[l], buf[cur], FxLocalStore{buf[cur ^ 1u]}, p.width[l],
                 0u, p.width[l + 1], p.act[l], (p.vec4_mask >> l) & 1u);
        cur ^= 1u;
        __syncthreads();
    }
    return fx_head_argmax(p, buf[cur], scores, values);
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
extern "C" __global__ void __launch_bounds__(512, 1) fx_mlp_serve(const FxMlpParams p, const volatile float* obs,
                                                               const unsigned int* ctrl, volatile unsigned int* reply,
                                                               unsigned int first) {
    __shared__ __align__(16) float buf[2][FX_MLP_MAX_WIDTH];
    __shared__ float scores[FX_MLP_MAX_ACTIONS + 1];
    __shared__ unsigned int s_seq, s_stop;
    unsigned int last = first;
    for (;;) {
        if (threadIdx.x == 0) fx_poll_request(ctrl, last, &s_seq, &s_stop);
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
