#!/usr/bin/env bash
# The fourth device command of 2026-12-03 (session 11), from the repo root on the H200 machine
# with .gpu/ packed (tests: the fx-kernels and fx-quant libs with CUDA; bin: release/fx-train):
# after the review pass (Decide::act_batch checks a whole batch first, one chunked u32 path for
# CpuPolicy and the GPU decider) and the F32 batch pass packing its six rows input-major
# (AVX-512: 64 outputs a block). Every CPU test of the INT8 and F32 policies on the host's
# Xeon and the GPU decider's on the H200, the printouts, three fx / PyTorch pairs.
# Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
lscpu > $W/cpu/cpu.txt 2>&1
timeout 150 bash .gpu/run.sh tests gemv_i8 policy:: qnet skew guard decide mlp_cpu tft::tests gpu_policy --test-threads 8 > $W/tests.log 2>&1
timeout 150 bash .gpu/run.sh tests int8_batch_phases int8_layouts dqn_sized_decision_time --ignored --nocapture --test-threads 1 > $W/timing.log 2>&1
for k in 1 2 3; do
  timeout 80 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 80 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
tar czf $O/all.tgz -C $W .
