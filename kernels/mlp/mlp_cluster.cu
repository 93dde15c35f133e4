// fx-arch: compute_90
// The greedy policy MLP of fx_mlp.cuh with one row spread over a thread-block cluster of
// FX_CLUSTER blocks on as many SMs (Hopper+: built for compute_90; mlp.rs loads it only on
// such a device and otherwise keeps mlp_forward.cu's block-per-row kernel). At batch 1 one
// SM pulling the whole network from L2 is what bounds the single-block kernel; here each
// block computes 1/FX_CLUSTER of every hidden layer's neurons from its own slice of the
// weights and pushes them into every block's shared memory (distributed shared memory), and
// one cluster barrier per layer publishes them. The head (a few rows) is computed by every
// block from its full copy of the last hidden layer, so it needs no barrier; rank 0 writes.
//
// Double buffering makes one barrier per layer enough: layer l reads buf[c] and writes
// buf[c^1] everywhere; a block writes buf[c] of another block again only in layer l+1, after
// that block has arrived at layer l's barrier, i.e. after its reads of buf[c].
#include <cooperative_groups.h>

#include "fx_mlp.cuh"

namespace cg = cooperative_groups;

#define FX_CLUSTER 8

// Stores a neuron's output into the same place of every block's shared buffer.
struct FxClusterStore {
    float* y[FX_CLUSTER];
    __device__ __forceinline__ void operator()(unsigned int n, float v) const {
#pragma unroll
        for (int r = 0; r < FX_CLUSTER; ++r) y[r][n] = v;
    }
};

// The rows [lo, hi) of hidden layer l that block `rank` computes.
__device__ __forceinline__ void fx_cluster_slice(const FxMlpParams& p, unsigned int l, unsigned int rank,
                                                 unsigned int* lo, unsigned int* hi) {
    const unsigned int out = p.width[l + 1], per = (out + FX_CLUSTER - 1) / FX_CLUSTER;
    *lo = min(out, rank * per);
    *hi = min(out, *lo + per);
}

// Asks for the 128-byte lines of n floats at a to be brought into this SM's L1.
__device__ __forceinline__ void fx_prefetch_l1(const float* a, size_t n) {
    const size_t end = reinterpret_cast<size_t>(a + n);
    for (size_t line = (reinterpret_cast<size_t>(a) & ~size_t(127)) + 128 * threadIdx.x; line < end;
         line += 128 * blockDim.x)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(line));
}

// Brings this block's weights (its rows of every hidden layer, and the whole head) into L1,
// for the resident server: its blocks then find them there request after request (a
// block's share of the default DQN is ~58 KB, well within L1; rows [lo, hi) of a [out, in]
// matrix are one contiguous range). The launched kernel does not: on the H200 a prefetch at
// its start made a call slower (6.25 -> 6.53 us in a quick H200 run, not kept), the layers' own loads being as early.
__device__ void fx_prefetch_cluster_weights(const FxMlpParams& p, unsigned int rank) {
    for (unsigned int l = 0; l < p.n_hidden; ++l) {
        unsigned int lo, hi;
        fx_cluster_slice(p, l, rank, &lo, &hi);
        fx_prefetch_l1(p.w[l] + (size_t)lo * p.width[l], (size_t)(hi - lo) * p.width[l]);
    }
    const unsigned int nh = p.n_hidden, k = p.width[nh];
    if (p.head == FX_HEAD_DUELING) {
        fx_prefetch_l1(p.w[nh], k);
        fx_prefetch_l1(p.w[nh + 1], (size_t)p.n_actions * k);
    } else {
        fx_prefetch_l1(p.w[nh], (size_t)p.n_actions * k);
    }
}

__device__ __forceinline__ void fx_cluster_arrive() { asm volatile("barrier.cluster.arrive.aligned;" ::: "memory"); }
__device__ __forceinline__ void fx_cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

// The greedy action of the row in xin (shared memory, FX_MLP_MAX_WIDTH floats) of every
// block of the cluster, all their threads taking part. Layer 0 reads xin and writes buf[0];
// layer l > 0 reads buf[(l-1)&1] and writes buf[l&1]; the head reads the last of them (xin
// with no hidden layer). A block writes xin again (the next input) only after its own row,
// so after every layer barrier, i.e. after every block has read it. Returns the action in
// thread 0 of every block (the same in each); the scores go to `values` when given (rank
// 0's thread 0 writes them).
//
// `arrived`: the caller has arrived at the row's start barrier but not waited. Layer 0 then
// computes into `stage` first and waits only before pushing its neurons out, so the wait
// for the other blocks (started, past their previous row) can overlap the layer's loads
// (in a quick H200 run, not kept, the difference was below the noise: 6.28 us a call).
// Otherwise the caller has passed a whole barrier already.
__device__ unsigned int fx_greedy_row_cluster(const FxMlpParams& p, const float* xin, float* stage,
                                              float (*buf)[FX_MLP_MAX_WIDTH], float* scores,
                                              float* __restrict__ values, bool arrived) {
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int rank = cluster.block_rank();
    const float* x = xin;
    if (arrived && p.n_hidden == 0) fx_cluster_wait();
    for (unsigned int l = 0; l < p.n_hidden; ++l) {
        unsigned int lo, hi;
        fx_cluster_slice(p, l, rank, &lo, &hi);
        float* y = buf[l & 1u];
        float* remote[FX_CLUSTER];
#pragma unroll
        for (int r = 0; r < FX_CLUSTER; ++r) remote[r] = cluster.map_shared_rank(y, r);
        const bool v4 = (p.vec4_mask >> l) & 1u;
        if (l == 0 && arrived) {
            fx_layer(p.w[l], p.b[l], p.width[1], p.w[l], p.b[l], x, FxLocalStore{stage}, p.width[0], lo, hi, p.act[l],
                     v4);
            __syncthreads();  // stage is complete
            fx_cluster_wait();
            for (unsigned int n = lo + threadIdx.x; n < hi; n += blockDim.x) {
                const float v = stage[n];
#pragma unroll
                for (int r = 0; r < FX_CLUSTER; ++r) remote[r][n] = v;
            }
        } else {
            FxClusterStore store;
#pragma unroll
            for (int r = 0; r < FX_CLUSTER; ++r) store.y[r] = remote[r];
            fx_layer(p.w[l], p.b[l], p.width[l + 1], p.w[l], p.b[l], x, store, p.width[l], lo, hi, p.act[l], v4);
        }
        cluster.sync();  // release our stores, acquire everyone's
        x = y;
    }
    return fx_head_argmax(p, x, scores, rank == 0 ? values : nullptr);
}

// obs [batch, width[0]] f32 row-major; actions [batch] u32; values [batch, n_actions] f32 or
// null. Grid: a multiple of FX_CLUSTER blocks of 256 threads; cluster c takes rows c,
// c + clusters, ...
extern "C" __global__ void __cluster_dims__(FX_CLUSTER, 1, 1) __launch_bounds__(256, 1)
    fx_mlp_greedy_cluster(const FxMlpParams p, const float* __restrict__ obs, unsigned int batch,
                          unsigned int* __restrict__ actions, float* __restrict__ values) {
    __shared__ __align__(16) float xin[FX_MLP_MAX_WIDTH];
    __shared__ __align__(16) float stage[FX_MLP_MAX_WIDTH];
    __shared__ __align__(16) float buf[2][FX_MLP_MAX_WIDTH];
    __shared__ float scores[FX_MLP_MAX_ACTIONS + 1];
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int n_clusters = gridDim.x / FX_CLUSTER, rank = cluster.block_rank();
    for (unsigned int row = blockIdx.x / FX_CLUSTER; row < batch; row += n_clusters) {
        // The row's start barrier: this block has started (its shared memory may be
        // written) and, on later rows, is past the previous row's head, which may read buf.
        // The wait comes inside the row, just before the first remote store.
        fx_cluster_arrive();
        const float* x = obs + (size_t)row * p.width[0];
        for (unsigned int k = threadIdx.x; k < p.width[0]; k += blockDim.x) xin[k] = x[k];
        __syncthreads();
        float* v = values ? values + (size_t)row * p.n_actions : nullptr;
        const unsigned int a = fx_greedy_row_cluster(p, xin, stage, buf, scores, v, true);
        if (rank == 0 && threadIdx.x == 0) actions[row] = a;
    }
}

// fx_mlp_serve (mlp_forward.cu) on a cluster: rank 0 polls the request, reads the
// observation over the bus (as the one-block server does: one set of bus reads) and pushes
// it, the sequence number and the stop flag into every block's shared memory; a cluster
// barrier releases them all. The weights stay in each block's L1 between requests.
extern "C" __global__ void __cluster_dims__(FX_CLUSTER, 1, 1) __launch_bounds__(256, 1)
    fx_mlp_serve_cluster(const FxMlpParams p, const volatile float* obs, const unsigned int* ctrl,
                         volatile unsigned int* reply, unsigned int first) {
    __shared__ __align__(16) float xin[FX_MLP_MAX_WIDTH];
    __shared__ __align__(16) float buf[2][FX_MLP_MAX_WIDTH];
    __shared__ float scores[FX_MLP_MAX_ACTIONS + 1];
    __shared__ unsigned int s_seq, s_stop;
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int rank = cluster.block_rank();
    unsigned int last = first;
    fx_prefetch_cluster_weights(p, rank);
    cluster.sync();  // every block has started before rank 0 writes into it
    for (;;) {
        if (rank == 0) {
            if (threadIdx.x == 0) fx_poll_request(ctrl, last, &s_seq, &s_stop);
            __syncthreads();  // rank 0's threads only: the whole block takes this branch
            const unsigned int seq = s_seq, stop = s_stop;
            // The acquire load of ctrl[0] orders these reads after the host's observation
            // writes (and the barrier above carries that order to this block's threads).
            if (stop == 0u)
                for (unsigned int k = threadIdx.x; k < p.width[0]; k += blockDim.x) {
                    const float v = obs[k];
#pragma unroll
                    for (int r = 0; r < FX_CLUSTER; ++r) cluster.map_shared_rank(xin, r)[k] = v;
                }
            if (threadIdx.x == 0)
#pragma unroll
                for (int r = 1; r < FX_CLUSTER; ++r) {
                    *cluster.map_shared_rank(&s_seq, r) = seq;
                    *cluster.map_shared_rank(&s_stop, r) = stop;
                }
        }
        // Publishes the request (rank 0's stores) to every block. Rank 0 stores into a block
        // only after its own row, so after every layer barrier of the previous request, by
        // which every block has read s_seq, s_stop and xin.
        cluster.sync();
        if (s_stop != 0u) return;  // all blocks together, after the barrier: no remote access follows
        const unsigned int seq = s_seq;
        const unsigned int a = fx_greedy_row_cluster(p, xin, nullptr, buf, scores, nullptr, false);
        // With no hidden layer the row has no barrier of its own to keep rank 0's next
        // stores behind this block's reads.
        if (p.n_hidden == 0) cluster.sync();
        if (rank == 0 && threadIdx.x == 0) {
            reply[0] = a;
            __threadfence_system();  // the action is visible before the sequence number
            reply[1] = seq;
        }
        last = seq;
    }
}
