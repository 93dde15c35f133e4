// Generalised advantage estimation: one thread per account, one pass backwards over T
// steps, accumulated in double (the CPU reference in crates/fx-kernels/src/gae.rs):
//   delta_t = r_t + gamma (1 - d_t) V_{t+1} - V_t,  A_t = delta_t + gamma lambda (1 - d_t) A_{t+1},
//   R_t = A_t + V_t, with V_T = last_value. Arrays are [T, E] row-major.
extern "C" __global__ void fx_gae(const float* __restrict__ rewards, const float* __restrict__ values,
                                  const float* __restrict__ dones, const float* __restrict__ last_value,
                                  unsigned int T, unsigned int E, double gamma, double lambda,
                                  float* __restrict__ adv, float* __restrict__ ret) {
    double gl = __dmul_rn(gamma, lambda);
    for (unsigned int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
        double last = 0.0;
        double next_v = (double)last_value[e];
        for (unsigned int i = T; i-- > 0;) {
            size_t k = (size_t)i * E + e;
            double nonterm = __dsub_rn(1.0, (double)dones[k]);
            double v = (double)values[k];
            double delta = __dsub_rn(__dadd_rn((double)rewards[k], __dmul_rn(__dmul_rn(gamma, next_v), nonterm)), v);
            last = __dadd_rn(delta, __dmul_rn(__dmul_rn(gl, nonterm), last));
            adv[k] = (float)last;
            ret[k] = (float)__dadd_rn(last, v);
            next_v = v;
        }
    }
}
