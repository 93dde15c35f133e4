#!/usr/bin/env bash
# The third device command of 2026-12-02 (session 10), from the repo root on the H200 machine
# with .gpu/ packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train). As
# ../1-per-product/command.sh (fx-quant's INT8 tests on the host's CPU, the INT8 layouts'
# timing printout, three fx / PyTorch pairs of CPU decision benches) with the AMX tiles
# configured once per batch, plus: the products alone for 32 rows (timing_products_of_32_rows),
# the GPU INT8 policy's device tests and timing (its new 4/8-row kernel), and the GPU bench of
# DQN and PPO (fx and bench.py). Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
lscpu > $W/cpu/cpu.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
timeout 240 bash .gpu/run.sh tests gemv_i8 policy:: tft::tests guard gpu_policy cuda::mlp --test-threads 8 > $W/tests.log 2>&1
timeout 150 bash .gpu/run.sh tests timing_products_of_32_rows int8_layouts timing_int8_kernel_launches --ignored --nocapture --test-threads 1 > $W/timing.log 2>&1
for k in 1 2 3; do
  timeout 100 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 100 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
OUT=$W/gpu FX_BENCH_ARGS="--model dqn,ppo" TORCH_MODELS=dqn,ppo FX_TIMEOUT=150 TORCH_TIMEOUT=160 TORCH_BUDGET_S=120 \
  bash scripts/gpu-bench.sh > $W/gpu-bench.log 2>&1
tar czf $O/all.tgz -C $W .
