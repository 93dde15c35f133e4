#!/usr/bin/env bash
# The device command of 2026-12-02 (session 9), run from the repo root on the H200 with .gpu/
# packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train): the INT8 policy
# kernel's device tests (bit for bit against fx-quant's scalar reference) and the F32 MLP
# kernels' (the MlpPolicy they now share), a timing printout of back-to-back INT8 launches,
# then the GPU bench of DQN and PPO, fx and bench.py in one go (scripts/gpu-bench.sh).
# Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
timeout 200 bash .gpu/run.sh tests gpu_policy cuda::mlp --nocapture --test-threads 1 > $W/tests.log 2>&1
timeout 60 bash .gpu/run.sh tests timing_int8_kernel_launches --ignored --nocapture > $W/timing.log 2>&1
OUT=$W/gpu FX_BENCH_ARGS="--model dqn,ppo" TORCH_MODELS=dqn,ppo FX_TIMEOUT=200 TORCH_TIMEOUT=200 TORCH_BUDGET_S=150 \
  bash scripts/gpu-bench.sh > $W/gpu-bench.log 2>&1
tar czf $O/all.tgz -C $W .
