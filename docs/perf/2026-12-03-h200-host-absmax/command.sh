#!/usr/bin/env bash
# The third device command of 2026-12-03 (session 11), from the repo root on the H200 machine
# with .gpu/ packed (tests: the fx-kernels and fx-quant libs with CUDA; bin: release/fx-train):
# as ../2026-12-03-h200-host-skew/command.sh, after replacing `abs_max`'s f32::max chain
# (a NaN compare and blend per step, one dependent chain) by 32 running maxima of one
# `maxps` each, giving the INT8 quantiser an AVX-512 build, and merging the DQN's value and
# advantage heads into one INT8 layer (one quantised input, one products pass), and starting
# the AMX tiles at 16 rows a pass instead of 5. Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
lscpu > $W/cpu/cpu.txt 2>&1
timeout 150 bash .gpu/run.sh tests gemv_i8 policy:: qnet skew guard decide mlp_cpu tft::tests --test-threads 8 > $W/tests.log 2>&1
timeout 150 bash .gpu/run.sh tests int8_batch_phases int8_layouts --ignored --nocapture --test-threads 1 > $W/timing.log 2>&1
for k in 1 2 3; do
  timeout 80 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 80 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
tar czf $O/all.tgz -C $W .
