// fx-arch: compute_90
// One MAMBA-2 recurrent decode step — a new bar x [B, n_in] through every layer's conv and SSM
// state to the prediction [B] — in one launch on one thread-block cluster of C blocks, C = 16
// where the device allows that non-portable size, else 8 (Hopper+; wrapper
// crates/fx-models/src/mamba2/decode_cuda.rs, f64 reference decode_ref.rs, which also holds
// the shared-memory layout below as StepDims::smem_floats).
//
// Why one cluster: at batch 1 the step is a chain of ~13 dependent phases (embedding; per layer
// in_proj + conv, the SSD update + gate, out_proj + residual; norm_f + head), each a small GEMV
// over weights (7 MB F32 at the default size, L2-resident between calls). Kernel boundaries in a
// graph or grid-wide software barriers cost microseconds each; a cluster barrier is a hardware
// barrier, and distributed shared memory lets each block push its slice of every vector straight
// into the other blocks' shared memory. Each block owns 1/C of the rows of every big weight
// matrix and keeps a full copy of the vectors the next phase reads.
//
// Where the time went (clock64 stamps per phase and Nsight Compute's stall sampling, H200): not
// in arithmetic but in chains of dependent loads and in warps idling at barriers. A layer's small
// parameters (norm and conv weights, dt_bias, A_log, D) were read from global memory inside
// loops that also store, so each load waited for the one before (~500 cycles each); each block
// now copies them, and its rows' conv state, into shared memory with cp.async one layer ahead
// (group P, issued while the block waits at barrier 1; A_log and D of every layer once at the
// start; the gated norm's weight as group O after out_proj). The
// weight slices streamed from L2 at ~13 bytes a cycle while the block did nothing else (in_proj
// 5.8k cycles a layer at 16 blocks); copying them with per-thread cp.async stalled the issuing
// warps about as long, so at batch 1 (flags bit 0) they come by bulk copies of the copy engine,
// issued by one thread on an mbarrier, one layer ahead: this block's in_proj rows right after its
// in_proj GEMV, its out_proj rows after barrier 3, and the embedding's and head's weights at the
// start. The phases then read shared memory only, bar the SSM state (loaded into registers while
// the block waits at barrier 1). The rmsnorms run on every warp (each computes the row's root
// itself, one division a thread) instead of one warp per row, and the cluster is 16 blocks where
// the device allows it (unstaged: 53.0 against 62.3 µs, docs/perf/2026-12-02-h200-decode/
// tests-decode.log; the cycle counts above are probe runs, scripts/mamba2-step-probe).
//
// Phases of layer l (block `rank` of C, all its threads):
//  A. u = rmsnorm(h) (every block, every row); its rows [lo, hi) of zxbcdt = in_proj · u into a
//     local stage; each (b, row) then becomes its final value — z as is, xBC through the causal
//     conv (window = conv_state ++ new value; the state shifted in global memory, a channel's
//     state touched only by the block that owns its row) and SiLU, dt as softplus(dt + dt_bias)
//     — and is pushed into zx of every block. Cluster barrier 1.
//  B. its rows q = b·d_inner + c in [qlo, qhi) of the SSM state, a warp per row of N values:
//     s = exp(dt·A)·s + (x·dt)·B, y = C·s + D·x, yz = y·silu(z), s written back; yz pushed into
//     every block, with this block's partial Σ yz² per (batch row, group). Cluster barrier 2.
//  C. every block: each group's sqrt(mean + eps) from the C partials (summed in rank order), yz
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
// barrier, so blocks may exit. Staged copies (local only) are overwritten only after every thread
// of the block has passed a barrier that follows its last read of them; bulk copies are read
// after their mbarrier's phase completes, and every one issued is waited for before the block
// exits. Per-thread copies are read only after cp.async.wait_group and a barrier: the groups are
// issued in the order P_{l+1} (small parameters + conv state, after a block barrier at the end
// of phase A), O_{l+1} (after barrier 3), so before layer l's rmsnorm "all but the newest group" means P_l, and before the
// gated norm "all but the newest" means O_l.
//
// Every sum runs in a fixed order (lanes, then a butterfly; partials in rank order), so a step is
// bit-reproducible for a given C. No fast-math: expf, log1pf, sqrtf and
// divisions are IEEE-accurate, as the reference's f64 math needs.
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

// Largest cluster (the launch's cluster size C is read at run time: 8 or 16).
#define FX_S_MAX_CLUSTER 16
#ifndef FX_S_THREADS
#define FX_S_THREADS 512
#endif
#define FX_S_WARPS (FX_S_THREADS / 32)
#define FX_S_MAX_LAYERS 16
// d_state <= 128: an SSM state row lives in a warp's registers, FX_S_NV values a lane.
#define FX_S_MAX_STATE 128
#define FX_S_NV (FX_S_MAX_STATE / 32)
// SSM rows a warp holds at once (their state loads are in flight together).
#define FX_S_SSD_ROWS 2
// flags bit 0: stage each block's in_proj and out_proj rows in shared memory (bulk copies).
#define FX_S_FLAG_STAGE 1u

// Phase timestamps for a profile: scripts/mamba2-step-probe defines FX_S_TRACE and reads fx_s_trace.
#ifdef FX_S_TRACE
__device__ long long fx_s_trace[FX_S_MAX_CLUSTER][64];
#define FX_S_STAMP(i)                                                                           \
    do {                                                                                        \
        if (threadIdx.x == 0) fx_s_trace[cg::this_cluster().block_rank()][(i)] = clock64();    \
    } while (0)
#else
#define FX_S_STAMP(i) \
    do {              \
    } while (0)
#endif

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

// cp.async: global -> this block's shared memory without holding registers; groups complete in
// the order they were committed.
__device__ __forceinline__ void fx_s_cp4(float* dst, const float* src) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void fx_s_cp16(float* dst, const float* src) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void fx_s_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fx_s_wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// n contiguous floats src -> dst by the whole block (16-byte copies where both ends allow).
__device__ __forceinline__ void fx_s_copy(float* dst, const float* src, unsigned int n) {
    const bool v4 = ((reinterpret_cast<size_t>(src) | reinterpret_cast<size_t>(dst)) & 15u) == 0u && n % 4u == 0u;
    if (v4) {
        for (unsigned int i = 4 * threadIdx.x; i < n; i += 4 * FX_S_THREADS) fx_s_cp16(dst + i, src + i);
    } else {
        for (unsigned int i = threadIdx.x; i < n; i += FX_S_THREADS) fx_s_cp4(dst + i, src + i);
    }
}

// Bulk copies (the Hopper copy engine, one instruction for a whole contiguous range) completing
// on an mbarrier: a block's weight slices stream into its shared memory without occupying its
// threads or their load queues.
__device__ __forceinline__ unsigned int fx_s_saddr(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
// `arrivals`: the fx_s_bulk calls of each phase.
__device__ __forceinline__ void fx_s_mbar_init(unsigned long long* bar, unsigned int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(fx_s_saddr(bar)), "r"(arrivals) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One thread: `bytes` (a multiple of 16, both ends 16-byte aligned) from src into dst, the
// barrier's phase completing when they have landed.
__device__ __forceinline__ void fx_s_bulk(float* dst, const float* src, unsigned int bytes, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fx_s_saddr(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     fx_s_saddr(dst)),
                 "l"(src), "r"(bytes), "r"(fx_s_saddr(bar))
                 : "memory");
}
// Every thread: waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void fx_s_mbar_wait(unsigned long long* bar, unsigned int parity) {
    const unsigned int a = fx_s_saddr(bar);
    unsigned int done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ float fx_s_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fx_s_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float fx_s_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ unsigned int fx_s_r4(unsigned int n) { return (n + 3u) & ~3u; }

// Block `rank`'s share [lo, hi) of `total` items: ceil(total / C) each, the last ones may be short
// or empty.
__device__ __forceinline__ void fx_s_slice(unsigned int total, unsigned int rank, unsigned int nblk, unsigned int& lo,
                                           unsigned int& hi) {
    const unsigned int per = (total + nblk - 1) / nblk;
    lo = min(total, rank * per);
    hi = min(total, lo + per);
}

// v into element i of `buf` in every block of the cluster.
__device__ __forceinline__ void fx_s_push(float* buf, unsigned int i, float v) {
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int nblk = cluster.num_blocks();
#pragma unroll 4
    for (unsigned int r = 0; r < nblk; ++r) *cluster.map_shared_rank(buf + i, (int)r) = v;
}

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

template <bool GLOBAL>
__device__ __forceinline__ float4 fx_s_ld4(const float4* p) {
    if constexpr (GLOBAL) return __ldg(p);
    else return *p;
}
template <bool GLOBAL>
__device__ __forceinline__ float fx_s_ld1(const float* p) {
    if constexpr (GLOBAL) return __ldg(p);
    else return *p;
}

// store(row, b, W[row - w0, :] · act[b, :]) for rows [lo, hi) and b < nb, act [nb, cols] in
// shared memory; W holds rows from w0 on (GLOBAL: the whole matrix in global memory, w0 = 0;
// else this block's staged rows in shared memory, w0 = lo). A warp takes ROWS consecutive rows
// at a time (groups strided over the warps), its lanes the columns: float4 loads when cols % 4 ==
// 0 and W is 16-byte aligned (act's rows are then 16-byte aligned too), all ROWS rows' loads of
// UNROLL column steps issued before their FMAs; each sum is reduced across the warp in a fixed
// order and lane 0 stores it. Staging changes where W is read, not the order of any sum.
template <int MAXB, int ROWS, int UNROLL, bool GLOBAL, class Store>
__device__ __forceinline__ void fx_s_gemv(const float* __restrict__ W, unsigned int w0, unsigned int cols,
                                          unsigned int lo, unsigned int hi, const float* act, unsigned int nb,
                                          const Store& store) {
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
#pragma unroll UNROLL
            for (unsigned int k = lane; k < c4; k += 32) {
                float4 w[ROWS];
#pragma unroll
                for (int i = 0; i < ROWS; ++i)
                    w[i] = r0 + i < hi ? fx_s_ld4<GLOBAL>(w4 + (size_t)(r0 + i - w0) * c4 + k)
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
#pragma unroll UNROLL
            for (unsigned int k = lane; k < cols; k += 32) {
                float w[ROWS];
#pragma unroll
                for (int i = 0; i < ROWS; ++i)
                    w[i] = r0 + i < hi ? fx_s_ld1<GLOBAL>(W + (size_t)(r0 + i - w0) * cols + k) : 0.0f;
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

// rmsnorm of h's nb rows of `cols` with weight w (shared memory) into u, by the whole block:
// every warp computes each row's root itself (the same lanes-then-butterfly order, so the same
// value), then each thread writes its elements h / root · w. Ends with a block barrier.
template <int MAXB>
__device__ __forceinline__ void fx_s_rmsnorm(const float* h, const float* w, float* u, unsigned int nb,
                                             unsigned int cols, float eps) {
    const unsigned int lane = threadIdx.x % 32;
    float q[MAXB];
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        if (b < (int)nb) {
            const float* hb = h + (size_t)b * cols;
            float s = 0.0f;
            for (unsigned int k = lane; k < cols; k += 32) s = fmaf(hb[k], hb[k], s);
            q[b] = sqrtf(fx_s_warp_sum(s) / (float)cols + eps);
        }
    }
    for (unsigned int t = threadIdx.x; t < nb * cols; t += FX_S_THREADS) {
        const unsigned int b = t / cols, k = t % cols;
        float qb = q[0];
#pragma unroll
        for (int r = 1; r < MAXB; ++r)
            if (r == (int)b) qb = q[r];
        u[t] = h[t] / qb * w[k];
    }
    __syncthreads();
}

// The shared-memory layout (floats; StepDims::smem_floats mirrors it, each piece a multiple of
// 16 bytes). The staged pieces are single-buffered: one layer ahead at most.
struct FxStepSmem {
    float *h, *u, *zx, *yz, *stage, *ss, *sq;
    // P: norm_w [dm], this block's rows' conv weights [per_a, K] and bias [per_a] (xBC rows only),
    // their conv state [B, K-1, per_a], dt_bias [nh]: what phase A reads.
    float *p_norm, *p_convw, *p_convb, *p_cstate, *p_dtb;
    // Every layer's A_log and D [n_layer, nh] each (phase B's), copied once at the start, so that
    // P can take the next layer's values as soon as phase A is done.
    float *alog, *dd;
    // O: the gated norm's weight [di].
    float* o_gnorm;
    // With staging: this block's out_proj rows [per_o, di] and in_proj rows [per_a, dm], the
    // embedding's weight [dm, n_in], norm_f and the head's weight [dm] each.
    float *o_w, *i_w, *e_w, *f_w, *head_w;
    // The bulk copies' barriers: in_proj, out_proj (one phase a layer each), the embedding and
    // the head (one phase a launch).
    unsigned long long *bar_in, *bar_out, *bar_emb, *bar_head;
};

// Copies what layer L's phase A reads locally (group P): norm_w, conv weights, bias and state of
// this block's xBC rows [c0, c1) (as conv channels), dt_bias.
__device__ __forceinline__ void fx_s_stage_p(const FxStepLayer& L, const FxStepSmem& m, unsigned int lo,
                                             unsigned int hi, unsigned int per_a, unsigned int dm, unsigned int di,
                                             unsigned int cd, unsigned int nh, unsigned int K, unsigned int B) {
    fx_s_copy(m.p_norm, L.norm_w, dm);
    const unsigned int c0 = max(lo, di), c1 = min(hi, di + cd);
    if (c0 < c1) {
        const unsigned int nc = c1 - c0, r0 = c0 - lo;
        fx_s_copy(m.p_convw + r0 * K, L.conv_w + (size_t)(c0 - di) * K, nc * K);
        fx_s_copy(m.p_convb + r0, L.conv_b + (c0 - di), nc);
        for (unsigned int t = threadIdx.x; t < B * (K - 1) * nc; t += FX_S_THREADS) {
            const unsigned int c = t % nc, bk = t / nc;
            fx_s_cp4(m.p_cstate + (size_t)bk * per_a + r0 + c, L.conv_state + (size_t)bk * cd + (c0 - di) + c);
        }
    }
    fx_s_copy(m.p_dtb, L.dt_bias, nh);
}

template <int MAXB>
__device__ __forceinline__ void fx_s_step(const FxStepParams& p, const float* __restrict__ x,
                                          float* __restrict__ pred) {
    extern __shared__ __align__(16) float fx_s_smem[];
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned int rank = cluster.block_rank(), nblk = cluster.num_blocks();
    const unsigned int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned int B = p.batch, dm = p.d_model, di = p.d_inner, N = p.d_state, P = p.headdim, G = p.ngroups;
    const unsigned int K = p.d_conv, nh = di / P, gn = G * N, cd = di + 2 * gn, R = di + cd + nh;
    const unsigned int gs = di / G, hpg = nh / G, pairs = B * G;
    const unsigned int per_a = (R + nblk - 1) / nblk;
    const unsigned int per_q = (B * di + nblk - 1) / nblk;
    const unsigned int per_o = (dm + nblk - 1) / nblk;
    // Batch 1 only: the decision path. (ptxas 13.0 also crashes on the bulk copies in the
    // batch-8 instantiation; there the flag is ignored and the code compiled out.)
    const bool staged = MAXB == 1 && (p.flags & FX_S_FLAG_STAGE) != 0u;

    FxStepSmem m;
    m.bar_in = reinterpret_cast<unsigned long long*>(fx_s_smem);  // 4 barriers: 8 floats
    m.bar_out = m.bar_in + 1;
    m.bar_emb = m.bar_in + 2;
    m.bar_head = m.bar_in + 3;
    m.h = fx_s_smem + 8;                                  // [B, dm] residual stream
    m.u = m.h + fx_s_r4(B * dm);                          // [B, max(dm, n_in)] GEMV input
    m.zx = m.u + fx_s_r4(B * max(dm, p.n_in));            // [B, R] z | xBC (conv, SiLU) | dt
    m.yz = m.zx + fx_s_r4(B * R);                         // [B, di] gated SSD output
    m.stage = m.yz + fx_s_r4(B * di);                     // this block's rows of a phase
    m.ss = m.stage + fx_s_r4(max(B * per_a, per_q));      // [C, B·G] partial Σ yz²
    m.sq = m.ss + fx_s_r4(nblk * pairs);                  // [B·G] sqrt(mean + eps)
    m.p_norm = m.sq + fx_s_r4(pairs);
    m.p_convw = m.p_norm + fx_s_r4(dm);
    m.p_convb = m.p_convw + fx_s_r4(per_a * K);
    m.p_cstate = m.p_convb + fx_s_r4(per_a);
    m.p_dtb = m.p_cstate + fx_s_r4(B * (K - 1) * per_a);
    m.alog = m.p_dtb + fx_s_r4(nh);
    m.dd = m.alog + fx_s_r4(p.n_layer * nh);
    m.o_gnorm = m.dd + fx_s_r4(p.n_layer * nh);
    m.o_w = m.o_gnorm + fx_s_r4(di);
    m.i_w = m.o_w + (staged ? fx_s_r4(per_o * di) : 0u);
    m.e_w = m.i_w + (staged ? fx_s_r4(per_a * dm) : 0u);
    m.f_w = m.e_w + (staged ? fx_s_r4(dm * p.n_in) : 0u);
    m.head_w = m.f_w + (staged ? fx_s_r4(dm) : 0u);
    // The embedding's weight is a whole number of 16-byte pieces at the default size (256 · 51).
    const bool stage_e = staged && (dm * p.n_in) % 4u == 0u;

    FX_S_STAMP(0);
    fx_s_arrive();  // the start barrier, waited for before the first remote store
    unsigned int lo, hi, qlo, qhi, olo, ohi;
    fx_s_slice(R, rank, nblk, lo, hi);
    fx_s_slice(B * di, rank, nblk, qlo, qhi);
    fx_s_slice(dm, rank, nblk, olo, ohi);
    const unsigned int na = hi - lo, nq = qhi - qlo, chunks = (nq + FX_S_SSD_ROWS - 1) / FX_S_SSD_ROWS;
    const unsigned int no = ohi - olo;

    // Layer 0's weight slices start streaming first (thread 0 issues every bulk copy; a phase
    // per layer and barrier, waited for with parity l & 1). Zero-byte slices are not copied,
    // and their GEMVs have no rows to read.
    if (staged && tid == 0) {
        fx_s_mbar_init(m.bar_in, 1);
        fx_s_mbar_init(m.bar_out, 1);
        fx_s_mbar_init(m.bar_emb, 1);
        fx_s_mbar_init(m.bar_head, 2);
        if (stage_e) fx_s_bulk(m.e_w, p.embed_w, dm * p.n_in * 4u, m.bar_emb);
        if (na) fx_s_bulk(m.i_w, p.layer[0].in_proj + (size_t)lo * dm, na * dm * 4u, m.bar_in);
        if (no) fx_s_bulk(m.o_w, p.layer[0].out_proj + (size_t)olo * di, no * di * 4u, m.bar_out);
        // Only rank 0 computes the head, so only it copies (and waits for) its weights.
        if (rank == 0) {
            fx_s_bulk(m.f_w, p.norm_f, dm * 4u, m.bar_head);
            fx_s_bulk(m.head_w, p.head_w, dm * 4u, m.bar_head);
        }
    }

    // Layer 0's groups, in the steady order: P_0, O_0 (see Hazards).
    fx_s_stage_p(p.layer[0], m, lo, hi, per_a, dm, di, cd, nh, K, B);
    for (unsigned int l = 0; l < p.n_layer; ++l) {
        fx_s_copy(m.alog + l * nh, p.layer[l].a_log, nh);
        fx_s_copy(m.dd + l * nh, p.layer[l].d, nh);
    }
    fx_s_commit();
    fx_s_copy(m.o_gnorm, p.layer[0].gnorm_w, di);
    fx_s_commit();

    // Embedding, every block every row (52 KB of weights at the default size, cheaper than a
    // barrier, and it hides the start barrier and layer 0's copies): a thread a row, its n_in
    // loads in flight together and no cross-lane reduction (n_in is small).
    for (unsigned int t = tid; t < B * p.n_in; t += FX_S_THREADS) m.u[t] = x[t];
    __syncthreads();
    if (stage_e) fx_s_mbar_wait(m.bar_emb, 0);
    const float* ew = stage_e ? m.e_w : p.embed_w;
    for (unsigned int r = tid; r < dm; r += FX_S_THREADS) {
        const float* w = ew + (size_t)r * p.n_in;
        float acc[MAXB];
#pragma unroll
        for (int b = 0; b < MAXB; ++b) acc[b] = 0.0f;
#pragma unroll 8
        for (unsigned int k = 0; k < p.n_in; ++k) {
            const float wk = w[k];
#pragma unroll
            for (int b = 0; b < MAXB; ++b)
                if (b < (int)B) acc[b] = fmaf(wk, m.u[b * p.n_in + k], acc[b]);
        }
        const float bias = __ldg(p.embed_b + r);
#pragma unroll
        for (int b = 0; b < MAXB; ++b)
            if (b < (int)B) m.h[b * dm + r] = acc[b] + bias;
    }
    FX_S_STAMP(1);

    for (unsigned int l = 0; l < p.n_layer; ++l) {
        const FxStepLayer& L = p.layer[l];
        const bool next = l + 1 < p.n_layer;
        const unsigned int ts = 2 + 10 * l;  // the trace stamps' slot
        (void)ts;

        // A. rmsnorm, in_proj rows [lo, hi), conv / SiLU / softplus, pushed into zx.
        fx_s_wait_groups<1>();  // P_l
        __syncthreads();
        fx_s_rmsnorm<MAXB>(m.h, m.p_norm, m.u, B, dm, p.eps);
        FX_S_STAMP(ts + 0);
        if (staged) {
            if (na) fx_s_mbar_wait(m.bar_in, l & 1u);
            fx_s_gemv<MAXB, 4, 2, false>(m.i_w, lo, dm, lo, hi, m.u, B, FxStoreStage{m.stage, lo, per_a});
        } else {
            fx_s_gemv<MAXB, 4, 2, true>(L.in_proj, 0u, dm, lo, hi, m.u, B, FxStoreStage{m.stage, lo, per_a});
        }
        __syncthreads();
        // Every thread is past its reads of the in_proj slice: the next layer's may stream in.
        if (staged && next && tid == 0 && na)
            fx_s_bulk(m.i_w, p.layer[l + 1].in_proj + (size_t)lo * dm, na * dm * 4u, m.bar_in);
        FX_S_STAMP(ts + 1);
        if (l == 0) fx_s_wait();
        for (unsigned int t = tid; t < B * na; t += FX_S_THREADS) {
            const unsigned int b = t / na, jl = t % na, j = lo + jl;
            const float raw = m.stage[b * per_a + jl];
            float v = raw;
            if (j >= di && j < di + cd) {
                // window = (state rows 0 .. K-2, raw) · w[c, :] + bias; the state shifts by one.
                const unsigned int c = j - di;
                float* cs = L.conv_state + (size_t)b * (K - 1) * cd + c;
                const float* old = m.p_cstate + (size_t)b * (K - 1) * per_a + jl;
                const float* w = m.p_convw + (size_t)jl * K;
                float s = 0.0f;
                for (unsigned int k = 0; k + 1 < K; ++k) {
                    const float o = old[(size_t)k * per_a];
                    s = fmaf(w[k], o, s);
                    if (k > 0) cs[(size_t)(k - 1) * cd] = o;
                }
                s = fmaf(w[K - 1], raw, s);
                if (K > 1) cs[(size_t)(K - 2) * cd] = raw;
                v = fx_s_silu(s + m.p_convb[jl]);
            } else if (j >= di + cd) {
                v = fx_s_softplus(raw + m.p_dtb[j - di - cd]);
            }
            fx_s_push(m.zx, b * R + j, v);
        }
        __syncthreads();  // the whole block is past its reads of P
        FX_S_STAMP(ts + 2);
        fx_s_arrive();  // barrier 1
        // P takes the next layer's values while the block waits (they land long before its
        // rmsnorm); issued after the arrive, so no other block waits for the issue.
        if (next) fx_s_stage_p(p.layer[l + 1], m, lo, hi, per_a, dm, di, cd, nh, K, B);
        fx_s_commit();  // P_{l+1}

        // B. SSM rows [qlo, qhi), a warp per row; the first rows' state loads overlap the wait.
        float sv[FX_S_SSD_ROWS][FX_S_NV];
        if (warp < chunks) fx_s_load_state(L.ssm_state, qlo + warp * FX_S_SSD_ROWS, qhi, N, sv);
        fx_s_wait();
        FX_S_STAMP(ts + 3);
        for (unsigned int ci = warp; ci < chunks; ci += FX_S_WARPS) {
            if (ci != warp) fx_s_load_state(L.ssm_state, qlo + ci * FX_S_SSD_ROWS, qhi, N, sv);
#pragma unroll
            for (int i = 0; i < FX_S_SSD_ROWS; ++i) {
                const unsigned int q = qlo + ci * FX_S_SSD_ROWS + i;
                if (q < qhi) {
                    const unsigned int b = q / di, c = q % di, hh = c / P, g = hh / hpg;
                    const float* zb = m.zx + (size_t)b * R;
                    const float dt = zb[di + cd + hh];
                    const float decay = expf(dt * -expf(m.alog[l * nh + hh]));
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
                    y = fmaf(xv, m.dd[l * nh + hh], fx_s_warp_sum(y));
                    if (lane == 0) m.stage[q - qlo] = y * fx_s_silu(zb[c]);
                }
            }
        }
        __syncthreads();
        FX_S_STAMP(ts + 4);
        for (unsigned int pi = warp; pi < pairs; pi += FX_S_WARPS) {
            const unsigned int b = pi / G, g = pi % G;
            const unsigned int a0 = max(qlo, b * di + g * gs), a1 = min(qhi, b * di + (g + 1) * gs);
            float s = 0.0f;
            for (unsigned int q = a0 + lane; q < a1; q += 32) s = fmaf(m.stage[q - qlo], m.stage[q - qlo], s);
            s = fx_s_warp_sum(s);
            if (lane < nblk) *cluster.map_shared_rank(m.ss + rank * pairs + pi, (int)lane) = s;
        }
        for (unsigned int t = tid; t < nq; t += FX_S_THREADS) fx_s_push(m.yz, qlo + t, m.stage[t]);
        FX_S_STAMP(ts + 5);
        fx_s_arrive();  // barrier 2
        fx_s_wait();
        FX_S_STAMP(ts + 6);

        // C. gated RMSNorm in place, out_proj rows [olo, ohi) + residual, pushed into h.
        fx_s_wait_groups<1>();  // O_l
        for (unsigned int t = tid; t < pairs; t += FX_S_THREADS) {
            float s = 0.0f;
            for (unsigned int r = 0; r < nblk; ++r) s += m.ss[r * pairs + t];
            m.sq[t] = sqrtf(s / (float)gs + p.eps);
        }
        __syncthreads();
        for (unsigned int q = tid; q < B * di; q += FX_S_THREADS) {
            const unsigned int b = q / di, c = q % di;
            m.yz[q] = m.yz[q] / m.sq[b * G + c / gs] * m.o_gnorm[c];
        }
        __syncthreads();
        FX_S_STAMP(ts + 7);
        if (staged) {
            if (no) fx_s_mbar_wait(m.bar_out, l & 1u);
            fx_s_gemv<MAXB, 1, 4, false>(m.o_w, olo, di, olo, ohi, m.yz, B, FxStoreResidual{m.h, dm});
        } else {
            fx_s_gemv<MAXB, 1, 4, true>(L.out_proj, 0u, di, olo, ohi, m.yz, B, FxStoreResidual{m.h, dm});
        }
        FX_S_STAMP(ts + 8);
        fx_s_arrive();  // barrier 3
        fx_s_wait();
        FX_S_STAMP(ts + 9);
        if (next) fx_s_copy(m.o_gnorm, p.layer[l + 1].gnorm_w, di);
        // Every thread of the block is past barrier 3, so past its reads of the out_proj slice.
        if (staged && next && tid == 0 && no)
            fx_s_bulk(m.o_w, p.layer[l + 1].out_proj + (size_t)olo * di, no * di * 4u, m.bar_out);
        fx_s_commit();  // O_{l+1}
    }

    // norm_f + head: rank 0, a warp per row (everyone's h is complete after the last barrier).
    if (rank == 0) {
        if (staged) fx_s_mbar_wait(m.bar_head, 0);
        const float* nf = staged ? m.f_w : p.norm_f;
        const float* hw = staged ? m.head_w : p.head_w;
        for (unsigned int b = warp; b < B; b += FX_S_WARPS) {
            const float* hb = m.h + (size_t)b * dm;
            float s = 0.0f;
            for (unsigned int k = lane; k < dm; k += 32) s = fmaf(hb[k], hb[k], s);
            const float q = sqrtf(fx_s_warp_sum(s) / (float)dm + p.eps);
            float acc = 0.0f;
#pragma unroll 8
            for (unsigned int k = lane; k < dm; k += 32) acc = fmaf(hb[k] / q * nf[k], hw[k], acc);
            acc = fx_s_warp_sum(acc);
            if (lane == 0) pred[b] = acc + p.head_b[0];
        }
    }
    FX_S_STAMP(2 + 10 * p.n_layer);
    fx_s_wait_groups<0>();  // nothing may land in shared memory after the block exits
}

// Cluster dimensions are the launch's (8 or 16 blocks, the wrapper decides); the probe build may
// define FX_S_LAUNCH_ATTRS away.
#define FX_S_LAUNCH_ATTRS __launch_bounds__(FX_S_THREADS, 1)

// x [batch, n_in], pred [batch] (F32, contiguous); grid: one cluster of C blocks of FX_S_THREADS
// threads, dynamic shared memory StepDims::smem_floats(C, staged) · 4 bytes. _b1 takes batch 1,
// _b8 up to 8 rows (its accumulators sized for 8).
extern "C" __global__ void FX_S_LAUNCH_ATTRS fx_m2_step_b1(const FxStepParams p, const float* __restrict__ x,
                                                           float* __restrict__ pred) {
    fx_s_step<1>(p, x, pred);
}

extern "C" __global__ void FX_S_LAUNCH_ATTRS fx_m2_step_b8(const FxStepParams p, const float* __restrict__ x,
                                                           float* __restrict__ pred) {
    fx_s_step<8>(p, x, pred);
}
