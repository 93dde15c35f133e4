#!/usr/bin/env bash
# The device command of 2026-12-02 (session 8), run from the repo root on the H200 with .gpu/
# packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train): the INT8 variable
# selection kernel's and the GPU INT8 TFT forecaster's device tests (with the kernel's device
# time at batch 256), then the GPU bench of the TFT, fx and bench.py in one go
# (scripts/gpu-bench.sh). Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
timeout 200 bash .gpu/run.sh tests int8_variable_selection cuda_int8 --nocapture --test-threads 1 > $W/tests.log 2>&1
OUT=$W/gpu FX_BENCH_ARGS="--model tft" TORCH_MODELS=tft FX_TIMEOUT=220 TORCH_TIMEOUT=150 TORCH_BUDGET_S=120 \
  bash scripts/gpu-bench.sh > $W/gpu-bench.log 2>&1
tar czf $O/all.tgz -C $W .
