// Profiling probe of kernels/mamba2/mamba2_step.cu at the default MAMBA-2 size, batch 1, without the
// Rust wrapper (run.sh beside it builds and runs it with the device's nvcc): random weights, the
// kernel back to back between events, one launch + sync as a one-node graph (p50 / p99 of 2000),
// and with -DFX_S_TRACE the cycles of each phase per layer (clock64 at the kernel's FX_S_STAMP
// points, rank 0 and the slowest rank). `probe FLAGS BLOCKS`: FLAGS bit 0 stages the weights.
// The shared-memory size below mirrors StepDims::smem_floats; keep the two in step.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <chrono>
#include "../../kernels/mamba2/mamba2_step.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
static unsigned long long rs = 12345;
static float rnd(float a) { rs = rs * 6364136223846793005ULL + 1442695040888963407ULL; return a * (((rs >> 40) & 0xffffff) / 16777216.0f * 2 - 1); }
static float* up(size_t n, float a, float base = 0) { std::vector<float> h(n); for (auto& v : h) v = base + rnd(a); float* d; CK(cudaMalloc(&d, n * 4)); CK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice)); return d; }

int main(int argc, char** argv) {
    const unsigned B = 1, n_in = 51, dm = 256, nl = 4, di = 512, N = 64, P = 64, G = 1, K = 4;
    const unsigned nh = di / P, cd = di + 2 * G * N, R = di + cd + nh;
    FxStepParams p{};
    for (unsigned l = 0; l < nl; ++l) {
        FxStepLayer& L = p.layer[l];
        L.norm_w = up(dm, 0.1f, 1.0f); L.in_proj = up((size_t)R * dm, 0.0625f); L.conv_w = up(cd * K, 0.5f);
        L.conv_b = up(cd, 0.1f); L.dt_bias = up(nh, 0.5f); L.a_log = up(nh, 0.5f); L.d = up(nh, 1.0f);
        L.gnorm_w = up(di, 0.1f, 1.0f); L.out_proj = up((size_t)dm * di, 0.044f);
        L.conv_state = up((size_t)B * (K - 1) * cd, 0.5f); L.ssm_state = up((size_t)B * nh * P * N, 0.1f);
    }
    p.embed_w = up(dm * n_in, 0.14f); p.embed_b = up(dm, 0.1f); p.norm_f = up(dm, 0.1f, 1.0f);
    p.head_w = up(dm, 0.06f); p.head_b = up(1, 0.1f);
    p.batch = B; p.n_in = n_in; p.d_model = dm; p.n_layer = nl; p.d_inner = di; p.d_state = N; p.headdim = P;
    p.ngroups = G; p.d_conv = K; p.eps = 1e-5f; p.flags = argc > 1 ? atoi(argv[1]) : 0;
    float* x = up(B * n_in, 1.0f); float* pred; CK(cudaMalloc(&pred, 4 * B));
    const unsigned C = argc > 2 ? atoi(argv[2]) : 8;
    auto r4 = [](unsigned n) { return (n + 3) & ~3u; };
    const unsigned per_a = (R + C - 1) / C, per_q = (B * di + C - 1) / C, per_o = (dm + C - 1) / C;
    const bool staged = p.flags & 1;
    const size_t smem = 4 * (size_t)(8 + r4(B * dm) + r4(B * std::max(dm, n_in)) + r4(B * R) + r4(B * di) +
                        r4(std::max(B * per_a, per_q)) + r4(C * B * G) + r4(B * G) +
                        r4(dm) + r4(per_a * K) + r4(per_a) + r4(B * (K - 1) * per_a) + r4(nh) + 2 * r4(nl * nh) + r4(di) +
                        (staged ? r4(per_o * di) + r4(per_a * dm) + r4(dm * n_in) + 2 * r4(dm) : 0));
    auto f = fx_m2_step_b1;
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (C > 8) CK(cudaFuncSetAttribute(f, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaLaunchConfig_t cfg{}; cfg.gridDim = dim3(C); cfg.blockDim = dim3(FX_S_THREADS);
    cfg.dynamicSmemBytes = smem; cfg.stream = s;
    cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = C; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    auto launch = [&]() { CK(cudaLaunchKernelEx(&cfg, f, p, (const float*)x, pred)); };
    for (int i = 0; i < 50; ++i) launch();
    CK(cudaStreamSynchronize(s));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
        CK(cudaEventRecord(e0, s)); for (int i = 0; i < 200; ++i) launch(); CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms * 1000 / 200);
    }
    // one launch + sync, as the bench's graph mode does (graph of one kernel)
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal)); launch(); CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    std::vector<double> t;
    for (int i = 0; i < 2000; ++i) {
        auto a = std::chrono::steady_clock::now(); CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
    }
    std::sort(t.begin(), t.end());
    float hp; CK(cudaMemcpy(&hp, pred, 4, cudaMemcpyDeviceToHost));
    printf("cluster %d threads %d flags %u smem %zu: kernel %.2f us (back to back), graph+sync p50 %.2f p99 %.2f us, pred %g\n",
           C, FX_S_THREADS, p.flags, smem, best, t[1000], t[1980], hp);
#ifdef FX_S_TRACE
    launch(); CK(cudaStreamSynchronize(s));
    static long long tr[FX_S_MAX_CLUSTER][64]; CK(cudaMemcpyFromSymbol(tr, fx_s_trace, sizeof(tr)));
    const char* nm[10] = {"rmsnorm", "in_proj", "conv+push", "wait1", "ssd", "ssd-push", "wait2", "gnorm", "out_proj", "wait3"};
    printf("trace (cycles from the previous stamp; rank0 / max over ranks): embed %lld\n", tr[0][1] - tr[0][0]);
    for (unsigned l = 0; l < nl; ++l) {
        printf(" L%u:", l);
        for (int i = 0; i < 10; ++i) {
            const int a = 2 + 10 * l + i; long long mx = 0;
            for (unsigned r = 0; r < C; ++r) mx = std::max(mx, tr[r][a] - tr[r][a - 1]);
            printf(" %s %lld/%lld", nm[i], tr[0][a] - tr[0][a - 1], mx);
        }
        printf("\n");
    }
    printf(" head %lld, total rank0 %lld cycles\n", tr[0][2 + 10 * nl] - tr[0][1 + 10 * nl], tr[0][2 + 10 * nl] - tr[0][0]);
#endif
    return 0;
}
