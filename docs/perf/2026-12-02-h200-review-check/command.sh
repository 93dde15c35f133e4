#!/usr/bin/env bash
# The first device command of 2026-12-02 (session 10), run from the repo root on the H200 with
# .gpu/ packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train) at b8e41a7:
# the device tests of everything session 9's review pass changed without a GPU (the shared
# INT8 header in the TFT and policy kernels, CudaVsnI8's cached addresses, FlatGrn on CudaTft,
# MlpDecider's NaN check, the broadened INT8 policy test), the INT8 policy kernel's timing
# printout, then the GPU bench of DQN and PPO, fx and bench.py in one go. Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
timeout 220 bash .gpu/run.sh tests tft_int8 cuda_int8 gpu_policy cuda::mlp tft_vsn --nocapture --test-threads 1 > $W/tests.log 2>&1
timeout 60 bash .gpu/run.sh tests timing_int8_kernel_launches --ignored --nocapture > $W/timing.log 2>&1
OUT=$W/gpu FX_BENCH_ARGS="--model dqn,ppo" TORCH_MODELS=dqn,ppo FX_TIMEOUT=150 TORCH_TIMEOUT=160 TORCH_BUDGET_S=120 \
  bash scripts/gpu-bench.sh > $W/gpu-bench.log 2>&1
tar czf $O/all.tgz -C $W .
