// fx-arch: compute_90
// One MAMBA-2 recurrent decode step — a new bar x [B, n_in] through every layer's conv and SSM
// state to the prediction [B] — in one launch on one thread-block cluster of 8 blocks (Hopper+;
// wrapper crates/fx-kernels/src/cuda/mamba2_step.rs, f64 reference mamba2_step_ref.rs, which
// also holds the shared-memory layout below as StepDims::smem_floats).
//
// Why one cluster: at batch 1 the step is a chain of ~13 dependent phases (embedding; per layer
// in_proj + conv, the SSD update + gate, out_proj + residual; norm_f + head), each a small GEMV
// over weights (7 MB F32 at the default size, L2-resident between calls). Kernel boundaries in a
// graph or grid-wide software barriers cost microseconds each; a cluster barrier is a hardware
// barrier, and distributed shared memory lets each block push its slice of every vector straight
// into the other blocks' shared memory. Each block streams 1/8 of the rows of every big weight
// matrix (16-byte loads, a warp per group of rows) and keeps a full copy of the vectors the next
// phase reads.
//
// Phases of layer l (block `rank` of 8, all its threads):
//  A. u = rmsnorm(h) (every block, every row); its rows [lo, hi) of zxbcdt = in_proj · u into a
//     local stage; each (b, row) then becomes its final value — z as is, xBC through the causal
//     conv (window = conv_state ++ new value; the state shifted in global memory, a channel's
//     state touched only by the block that owns its row) and SiLU, dt as softplus(dt + dt_bias)
//     — and is pushed into zx of every block. Cluster barrier 1.
//  B. its rows q = b·d_inner + c in [qlo, qhi) of the SSM state, a warp per row of N values:
//     s = exp(dt·A)·s + (x·dt)·B, y = C·s + D·x, yz = y·silu(z), s written back; yz pushed into
//     every block, with this block's partial Σ yz² per (batch row, group). Cluster barrier 2.
//  C. every block: each group's sqrt(mean + eps) from the 8 partials (summed in rank order), yz
//     normalised and weighted in place; its rows [olo, ohi) of out_proj · yz added to h and pushed
//     into every block. Cluster barrier 3.
// After the last layer rank 0 computes norm_f + head into pred.
//
// Hazards: a buffer written remotely in a phase is read only after the next barrier, and written
// again only after a barrier that each reader reaches after its reads (zx: written in A, read in
// B, rewritten in A of l+1 after barrier 3; yz and ss: B -> C, rewritten after barrier 1 of l+1;
// h: a row is written only by its owner in C, read whole in A after barrier 3). The start barrier
// (arrive at entry, wait before layer 0's first push) makes sure every block of the cluster runs
// before anyone writes into its shared memory; nothing is accessed remotely after the last
// barrier, so blocks may exit. Between a barrier's arrive and its wait a block issues what does
// not depend on the others: the SSM state of its first rows (B) and, with flags bit 0, L1
// prefetches of what the next phase reads from global memory (its slice of the next weight
// matrix — for in_proj the first group of rows of each warp —, norm and conv parameters, the conv
// state), so that the phase's loads hit L1 instead of paying an L2 round trip each.
//
// Every sum runs in a fixed order (lanes, then a butterfly; partials in rank order), so a step is
// bit-reproducible. No fast-math: expf, log1pf, sqrtf and divisions are IEEE-accurate, as the
// reference's f64 math needs.
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#define FX_S_CLUSTER 8
#ifndef FX_S_THREADS
#define FX_S_THREADS 512
#endif
#define FX_S_WARPS (FX_S_THREADS / 32)
#define FX_S_MAX_LAYERS 16
// d_state <= 128: an SSM state row lives in a warp's registers, FX_S_NV values a lane.
#define FX_S_MAX_STATE 128
#define FX_S_NV (FX_S_MAX_STATE / 32)
// SSM rows a warp holds at once (their state loads are in flight together).
#define FX_S_SSD_ROWS 4
#define FX_S_FLAG_PREFETCH 1u

// One layer's parameters and recurrent state (F32, contiguous, row-major [out, in] weights).
struct FxStepLayer {
    const float* norm_w;    // [d_model]
    const float* in_proj;   // [d_inner + conv_dim + nheads, d_model]
    const float* conv_w;    // [conv_dim, d_conv]
    const float* conv_b;    // [conv_dim]
    const float* dt_bias;   // [nheads]
    const float* a_log;     // [nheads]
    const float* d;         // [nheads]
    const float* gnorm_w;   // [d_inner]
    const float* out_proj;  // [d_model, d_inner]
    float* conv_state;      // [B, d_conv - 1, conv_dim], updated in place
    float* ssm_state;       // [B, nheads, headdim, d_state], updated in place
};

// Field for field the `Params` of mamba2_step.rs (both sides assert the size).
struct FxStepParams {
    FxStepLayer layer[FX_S_MAX_LAYERS];
    const float* embed_w;  // [d_model, n_in]
    const float* embed_b;  // [d_model]
    const float* norm_f;   // [d_model]
    const float* head_w;   // [d_model]
    const float* head_b;   // [1]
    unsigned int batch, n_in, d_model, n_layer, d_inner, d_state, headdim, ngroups, d_conv;
    float eps;
    unsigned int flags;
    unsigned int pad_;
};
static_assert(sizeof(FxStepLayer) == 88, "FxStepLayer: 11 pointers");
static_assert(sizeof(FxStepParams) == 1496, "FxStepParams must match mamba2_step.rs's Params");

// Release / acquire (the defaults). Not .aligned: some arrives follow loops whose lanes leave at
// different iterations, and .aligned would need the warp provably converged there.
__device__ __forceinline__ void fx_s_arrive() { asm volatile("barrier.cluster.arrive;" ::: "memory"); }
__device__ __forceinline__ void fx_s_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }
__device__ __forceinline__ void fx_s_prefetch_line(size_t a) { asm volatile("prefetch.global.L1 [%0];" ::"l"(a)); }

__device__ __forceinline__ float fx_s_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fx_s_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float fx_s_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ unsigned int fx_s_r4(unsigned int n) { return (n + 3u) & ~3u; }

// Block `rank`'s share [lo, hi) of `total` items: ceil(total / 8) each, the last ones may be short
// or empty.
__device__ __forceinline__ void fx_s_slice(unsigned int total, unsigned int rank, unsigned int& lo,
                                           unsigned int& hi) {
    const unsigned int per = (total + FX_S_CLUSTER - 1) / FX_S_CLUSTER;
    lo = min(total, rank * per);
    hi = min(total, lo + per);
}

// Asks for the 128-byte lines of n floats at a to be brought into this SM's L1 (the whole block).
__device__ __forceinline__ void fx_s_prefetch(const float* a, size_t n) {
    const size_t end = reinterpret_cast<size_t>(a + n);
    for (size_t line = (reinterpret_cast<size_t>(a) & ~size_t(127)) + 128 * (size_t)threadIdx.x; line < end;
         line += 128 * (size_t)FX_S_THREADS)
        fx_s_prefetch_line(line);
}

// With flags bit 0, what phase A of layer l reads from global memory before its loads of later
// in_proj passes: norm_w, each warp's first group of in_proj rows, and for this block's rows
// [lo, hi) the conv state, weights and bias (xBC rows) and dt_bias (dt rows). Issued while the
// block waits at the barrier before the phase, so that those loads then hit L1.
__device__ __forceinline__ void fx_s_prefetch_a(const FxStepLayer& L, unsigned int lo, unsigned int hi,
                                                unsigned int dm, unsigned int di, unsigned int cd, unsigned int K,
                                                unsigned int B) {
    fx_s_prefetch(L.norm_w, dm);
    fx_s_prefetch(L.in_proj + (size_t)lo * dm, (size_t)(min(hi, lo + 4u * FX_S_WARPS) - lo) * dm);
    const unsigned int c0 = max(lo, di), c1 = min(hi, di + cd);
    if (c0 < c1) {
        fx_s_prefetch(L.conv_w + (size_t)(c0 - di) * K, (size_t)(c1 - c0) * K);
        fx_s_prefetch(L.conv_b + (c0 - di), c1 - c0);
        for (unsigned int b = 0; b < B; ++b)
            for (unsigned int k = 0; k + 1 < K; ++k)
                fx_s_prefetch(L.conv_state + ((size_t)b * (K - 1) + k) * cd + (c0 - di), c1 - c0);
    }
    const unsigned int h0 = max(lo, di + cd);
    if (h0 < hi) fx_s_prefetch(L.dt_bias + (h0 - di - cd), hi - h0);
}

// v into element i of `buf` in every block of the cluster.
__device__ __forceinline__ void fx_s_push(float* buf, unsigned int i, float v) {
    cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
    for (int r = 0; r < FX_S_CLUSTER; ++r) *cluster.map_shared_rank(buf + i, r) = v;
}

// The embedding's store: h[b, r] = v + bias[r] (local).
struct FxStoreBias {
    float* h;
    const float* bias;
    unsigned int ld;
    __device__ __forceinline__ void operator()(unsigned int r, unsigned int b, float v) const {
        h[b * ld + r] = v + bias[r];
    }
};

// in_proj's store: the local stage [b, r - lo].
struct FxStoreStage {
    float* stage;
    unsigned int lo, ld;
    __device__ __forceinline__ void operator()(unsigned int r, unsigned int b, float v) const {
        stage[b * ld + (r - lo)] = v;
    }
};

// out_proj's store: h[b, r] + v, the residual, into every block's h (r is this block's row).
struct FxStoreResidual {
    float* h;
    unsigned int ld;
    __device__ __forceinline__ void operator()(unsigned int r, unsigned int b, float v) const {
        const unsigned int i = b * ld + r;
        fx_s_push(h, i, h[i] + v);
    }
};

// store(row, b, W[row, :] · act[b, :]) for rows [lo, hi) and b < nb, act [nb, cols] in shared
// memory. A warp takes ROWS consecutive rows at a time (groups strided over the warps), its lanes
// the columns: float4 loads when cols % 4 == 0 and W is 16-byte aligned (act's rows are then
// 16-byte aligned too), all ROWS rows' loads issued before their FMAs; each sum is reduced across
// the warp in a fixed order and lane 0 stores it.
template <int MAXB, int ROWS, class Store>
__device__ __forceinline__ void fx_s_gemv(const float* __restrict__ W, unsigned int cols, unsigned int lo,
                                          unsigned int hi, const float* act, unsigned int nb, const Store& store) {
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int groups = (hi - lo + ROWS - 1) / ROWS;
    const bool v4 = (cols % 4u) == 0u && (reinterpret_cast<size_t>(W) & 15u) == 0u;
    for (unsigned int g = warp; g < groups; g += FX_S_WARPS) {
        const unsigned int r0 = lo + g * ROWS;
        float acc[ROWS][MAXB];
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
            for (int b = 0; b < MAXB; ++b) acc[i][b] = 0.0f;
        if (v4) {
            const unsigned int c4 = cols / 4u;
            const float4* w4 = reinterpret_cast<const float4*>(W);
            const float4* a4 = reinterpret_cast<const float4*>(act);
#pragma unroll 2
            for (unsigned int k = lane; k < c4; k += 32) {
                float4 w[ROWS];
#pragma unroll
                for (int i = 0; i < ROWS; ++i)
                    w[i] = r0 + i < hi ? __ldg(w4 + (size_t)(r0 + i) * c4 + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int b = 0; b < MAXB; ++b) {
                    if (b < (int)nb) {
                        const float4 a = a4[(size_t)b * c4 + k];
#pragma unroll
                        for (int i = 0; i < ROWS; ++i) {
                            acc[i][b] = fmaf(w[i].x, a.x, acc[i][b]);
                            acc[i][b] = fmaf(w[i].y, a.y, acc[i][b]);
                            acc[i][b] = fmaf(w[i].z, a.z, acc[i][b]);
                            acc[i][b] = fmaf(w[i].w, a.w, acc[i][b]);
                        }
                    }
                }
            }
        } else {
            for (unsigned int k = lane; k < cols; k += 32) {
                float w[ROWS];
#pragma unroll
                for (int i = 0; i < ROWS; ++i) w[i] = r0 + i < hi ? __ldg(W + (size_t)(r0 + i) * cols + k) : 0.0f;
#pragma unroll
                for (int b = 0; b < MAXB; ++b) {
                    if (b < (int)nb) {
                        const float a = act[(size_t)b * cols + k];
#pragma unroll
                        for (int i = 0; i < ROWS; ++i) acc[i][b] = fmaf(w[i], a, acc[i][b]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
            for (int b = 0; b < MAXB; ++b)
                if (b < (int)nb) {
                    const float v = fx_s_warp_sum(acc[i][b]);
                    if (lane == 0 && r0 + i < hi) store(r0 + i, (unsigned int)b, v);
                }
    }
}

// The state of SSM rows q0 .. q0 + FX_S_SSD_ROWS - 1 (those < qhi) into the warp's registers:
// lane holds n = lane + 32 v.
__device__ __forceinline__ void fx_s_load_state(const float* st, unsigned int q0, unsigned int qhi, unsigned int n,
                                                float (&sv)[FX_S_SSD_ROWS][FX_S_NV]) {
    const unsigned int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < FX_S_SSD_ROWS; ++i)
#pragma unroll
        for (int v = 0; v < FX_S_NV; ++v) {
            const unsigned int q = q0 + i, k = lane + 32 * v;
            sv[i][v] = q < qhi && k < n ? st[(size_t)q * n + k] : 0.0f;
        }
}

// rmsnorm of h's nb rows of `cols` with weight w into u (a warp per row): h / sqrt(mean(h²) + eps) · w.
__device__ __forceinline__ void fx_s_rmsnorm(const float* h, const float* __restrict__ w, float* u, unsigned int nb,
                                             unsigned int cols, float eps) {
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (unsigned int b = warp; b < nb; b += FX_S_WARPS) {
        const float* hb = h + (size_t)b * cols;
        float s = 0.0f;
        for (unsigned int k = lane; k < cols; k += 32) s = fmaf(hb[k], hb[k], s);
        const float q = sqrtf(fx_s_warp_sum(s) / (float)cols + eps);
        for (unsigned int k = lane; k < cols; k += 32) u[(size_t)b * cols + k] = hb[k] / q * w[k];
    }
}

template <int MAXB>
__device__ __forceinline__ void fx_s_step(const FxStepParams& p, const float* __restrict__ x,
                                          float* __restrict__ pred) {
    extern __shared__ __align__(16) float fx_s_smem[];
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int rank = cluster.block_rank();
    const unsigned int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned int B = p.batch, dm = p.d_model, di = p.d_inner, N = p.d_state, P = p.headdim, G = p.ngroups;
    const unsigned int K = p.d_conv, nh = di / P, gn = G * N, cd = di + 2 * gn, R = di + cd + nh;
    const unsigned int gs = di / G, hpg = nh / G, pairs = B * G;
    const unsigned int per_a = (R + FX_S_CLUSTER - 1) / FX_S_CLUSTER;
    const unsigned int per_q = (B * di + FX_S_CLUSTER - 1) / FX_S_CLUSTER;
    const bool prefetch = (p.flags & FX_S_FLAG_PREFETCH) != 0u;

    // Shared memory, each piece a multiple of 16 bytes (StepDims::smem_floats).
    float* h = fx_s_smem;                                       // [B, dm] residual stream
    float* u = h + fx_s_r4(B * dm);                             // [B, max(dm, n_in)] GEMV input
    float* zx = u + fx_s_r4(B * max(dm, p.n_in));               // [B, R] z | xBC (conv, SiLU) | dt
    float* yz = zx + fx_s_r4(B * R);                            // [B, di] gated SSD output
    float* stage = yz + fx_s_r4(B * di);                        // this block's rows of a phase
    float* ss = stage + fx_s_r4(max(B * per_a, per_q));         // [8, B·G] partial Σ yz²
    float* sq = ss + fx_s_r4(FX_S_CLUSTER * pairs);             // [B·G] sqrt(mean + eps)

    fx_s_arrive();  // the start barrier, waited for before the first remote store
    unsigned int lo, hi, qlo, qhi, olo, ohi;
    fx_s_slice(R, rank, lo, hi);
    fx_s_slice(B * di, rank, qlo, qhi);
    fx_s_slice(dm, rank, olo, ohi);
    const unsigned int na = hi - lo, nq = qhi - qlo, chunks = (nq + FX_S_SSD_ROWS - 1) / FX_S_SSD_ROWS;
    if (prefetch) fx_s_prefetch_a(p.layer[0], lo, hi, dm, di, cd, K, B);

    // Embedding, every block every row: 52 KB of weights at the default size, cheaper than a
    // barrier, and it hides the start barrier.
    for (unsigned int t = tid; t < B * p.n_in; t += FX_S_THREADS) u[t] = x[t];
    __syncthreads();
    fx_s_gemv<MAXB, 4>(p.embed_w, p.n_in, 0u, dm, u, B, FxStoreBias{h, p.embed_b, dm});
    __syncthreads();

    for (unsigned int l = 0; l < p.n_layer; ++l) {
        const FxStepLayer& L = p.layer[l];

        // A. rmsnorm, in_proj rows [lo, hi), conv / SiLU / softplus, pushed into zx.
        fx_s_rmsnorm(h, L.norm_w, u, B, dm, p.eps);
        __syncthreads();
        fx_s_gemv<MAXB, 4>(L.in_proj, dm, lo, hi, u, B, FxStoreStage{stage, lo, per_a});
        __syncthreads();
        if (l == 0) fx_s_wait();
        for (unsigned int t = tid; t < B * na; t += FX_S_THREADS) {
            const unsigned int b = t / na, j = lo + t % na;
            const float raw = stage[b * per_a + (j - lo)];
            float v = raw;
            if (j >= di && j < di + cd) {
                // window = (state rows 0 .. K-2, raw) · w[c, :] + bias; the state shifts by one.
                const unsigned int c = j - di;
                float* cs = L.conv_state + (size_t)b * (K - 1) * cd + c;
                const float* w = L.conv_w + (size_t)c * K;
                float s = 0.0f;
                for (unsigned int k = 0; k + 1 < K; ++k) {
                    const float old = cs[(size_t)k * cd];
                    s = fmaf(w[k], old, s);
                    if (k > 0) cs[(size_t)(k - 1) * cd] = old;
                }
                s = fmaf(w[K - 1], raw, s);
                if (K > 1) cs[(size_t)(K - 2) * cd] = raw;
                v = fx_s_silu(s + L.conv_b[c]);
            } else if (j >= di + cd) {
                v = fx_s_softplus(raw + L.dt_bias[j - di - cd]);
            }
            fx_s_push(zx, b * R + j, v);
        }
        fx_s_arrive();  // barrier 1

        // B. SSM rows [qlo, qhi), a warp per row; the first rows' state loads overlap the wait.
        float sv[FX_S_SSD_ROWS][FX_S_NV];
        if (warp < chunks) fx_s_load_state(L.ssm_state, qlo + warp * FX_S_SSD_ROWS, qhi, N, sv);
        if (prefetch) {
            fx_s_prefetch(L.a_log, nh);
            fx_s_prefetch(L.d, nh);
        }
        fx_s_wait();
        for (unsigned int ci = warp; ci < chunks; ci += FX_S_WARPS) {
            if (ci != warp) fx_s_load_state(L.ssm_state, qlo + ci * FX_S_SSD_ROWS, qhi, N, sv);
#pragma unroll
            for (int i = 0; i < FX_S_SSD_ROWS; ++i) {
                const unsigned int q = qlo + ci * FX_S_SSD_ROWS + i;
                if (q < qhi) {
                    const unsigned int b = q / di, c = q % di, hh = c / P, g = hh / hpg;
                    const float* zb = zx + (size_t)b * R;
                    const float dt = zb[di + cd + hh];
                    const float decay = expf(dt * -expf(L.a_log[hh]));
                    const float xv = zb[di + c], xs = xv * dt;
                    const float* bn = zb + di + di + g * N;
                    const float* cn = bn + gn;
                    float y = 0.0f;
#pragma unroll
                    for (int v = 0; v < FX_S_NV; ++v) {
                        const unsigned int k = lane + 32 * v;
                        if (k < N) {
                            const float s = fmaf(xs, bn[k], sv[i][v] * decay);
                            L.ssm_state[(size_t)q * N + k] = s;
                            y = fmaf(s, cn[k], y);
                        }
                    }
                    y = fmaf(xv, L.d[hh], fx_s_warp_sum(y));
                    if (lane == 0) stage[q - qlo] = y * fx_s_silu(zb[c]);
                }
            }
        }
        __syncthreads();
        for (unsigned int pi = warp; pi < pairs; pi += FX_S_WARPS) {
            const unsigned int b = pi / G, g = pi % G;
            const unsigned int a0 = max(qlo, b * di + g * gs), a1 = min(qhi, b * di + (g + 1) * gs);
            float s = 0.0f;
            for (unsigned int q = a0 + lane; q < a1; q += 32) s = fmaf(stage[q - qlo], stage[q - qlo], s);
            s = fx_s_warp_sum(s);
            if (lane < FX_S_CLUSTER) *cluster.map_shared_rank(ss + rank * pairs + pi, (int)lane) = s;
        }
        for (unsigned int t = tid; t < nq; t += FX_S_THREADS) fx_s_push(yz, qlo + t, stage[t]);
        fx_s_arrive();  // barrier 2
        if (prefetch) {
            fx_s_prefetch(L.out_proj + (size_t)olo * di, (size_t)(ohi - olo) * di);
            fx_s_prefetch(L.gnorm_w, di);
        }
        fx_s_wait();

        // C. gated RMSNorm in place, out_proj rows [olo, ohi) + residual, pushed into h.
        for (unsigned int t = tid; t < pairs; t += FX_S_THREADS) {
            float s = 0.0f;
#pragma unroll
            for (int r = 0; r < FX_S_CLUSTER; ++r) s += ss[r * pairs + t];
            sq[t] = sqrtf(s / (float)gs + p.eps);
        }
        __syncthreads();
        for (unsigned int q = tid; q < B * di; q += FX_S_THREADS) {
            const unsigned int b = q / di, c = q % di;
            yz[q] = yz[q] / sq[b * G + c / gs] * L.gnorm_w[c];
        }
        __syncthreads();
        fx_s_gemv<MAXB, 2>(L.out_proj, di, olo, ohi, yz, B, FxStoreResidual{h, dm});
        fx_s_arrive();  // barrier 3
        if (prefetch) {
            if (l + 1 < p.n_layer) {
                fx_s_prefetch_a(p.layer[l + 1], lo, hi, dm, di, cd, K, B);
            } else if (rank == 0) {
                fx_s_prefetch(p.norm_f, dm);
                fx_s_prefetch(p.head_w, dm);
            }
        }
        fx_s_wait();
    }

    // norm_f + head: rank 0, a warp per row (everyone's h is complete after the last barrier).
    if (rank == 0) {
        for (unsigned int b = warp; b < B; b += FX_S_WARPS) {
            const float* hb = h + (size_t)b * dm;
            float s = 0.0f;
            for (unsigned int k = lane; k < dm; k += 32) s = fmaf(hb[k], hb[k], s);
            const float q = sqrtf(fx_s_warp_sum(s) / (float)dm + p.eps);
            float acc = 0.0f;
            for (unsigned int k = lane; k < dm; k += 32) acc = fmaf(hb[k] / q * p.norm_f[k], p.head_w[k], acc);
            acc = fx_s_warp_sum(acc);
            if (lane == 0) pred[b] = acc + p.head_b[0];
        }
    }
}

// x [batch, n_in], pred [batch] (F32, contiguous); grid: one cluster of 8 blocks of FX_S_THREADS
// threads, dynamic shared memory StepDims::smem_floats() · 4 bytes. _b1 takes batch 1, _b8 up
// to 8 rows (its accumulators sized for 8).
extern "C" __global__ void __cluster_dims__(FX_S_CLUSTER, 1, 1) __launch_bounds__(FX_S_THREADS, 1)
    fx_m2_step_b1(const FxStepParams p, const float* __restrict__ x, float* __restrict__ pred) {
    fx_s_step<1>(p, x, pred);
}

extern "C" __global__ void __cluster_dims__(FX_S_CLUSTER, 1, 1) __launch_bounds__(FX_S_THREADS, 1)
    fx_m2_step_b8(const FxStepParams p, const float* __restrict__ x, float* __restrict__ pred) {
    fx_s_step<8>(p, x, pred);
}
