#!/usr/bin/env bash
# The device command of 2026-12-02 (session 7), run from the repo root on the H200 with .gpu/
# packed (tests: the fx-models lib; bin: release/fx-train): the CUDA TFT forecaster's device
# test and its per-section profile at batch 256, the GPU bench of the TFT (fx and bench.py in
# one go: scripts/gpu-bench.sh), and the CPU bench of the TFT (eager F32 and INT8) on the
# host's Xeon, twice. Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
timeout 150 bash .gpu/run.sh tests forecast fused_forecast_time_and_profile --nocapture --test-threads 1 > $W/tests.log 2>&1
OUT=$W/gpu FX_BENCH_ARGS="--model tft" TORCH_MODELS=tft FX_TIMEOUT=200 TORCH_TIMEOUT=200 TORCH_BUDGET_S=150 \
  bash scripts/gpu-bench.sh > $W/gpu-bench.log 2>&1
lscpu > $W/cpu/cpu.txt
for k in 1 2; do
  timeout 120 bash .gpu/run.sh bin fx-train bench --device cpu --model tft --steps 3 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
done
tar czf $O/all.tgz -C $W .
