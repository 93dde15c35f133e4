// fx-quant's INT8 arithmetic, shared by the INT8 kernels (mlp_int8.cu, tft_int8.cu). The CPU
// twins are fx_quant::qnet::quantize_input and the dequantisation of
// fx_quant::reference::reference_scores; each rounding is explicit, so that nvcc cannot fuse
// a multiply and an add and the kernels match those references bit for bit.
#pragma once

// clamp(round_half_even(x * inv), ±127): the one rounding rule for activations.
__device__ __forceinline__ int fx_q8(float x, float inv) {
    const float v = fminf(fmaxf(rintf(__fmul_rn(x, inv)), -127.0f), 127.0f);
    return (int)v;
}

// An int32 product sum back to F32: float(acc) · (w_scale · step) + bias.
__device__ __forceinline__ float fx_dq8(int acc, float w_scale, float step, float bias) {
    return __fadd_rn(__fmul_rn(__int2float_rn(acc), __fmul_rn(w_scale, step)), bias);
}
