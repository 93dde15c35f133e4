#!/usr/bin/env bash
# The fifth device command (run after the session's review pass) of 2026-12-02 (session 10), from the repo root on the H200 machine
# with .gpu/ packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train): as
# ../3-fused-epilogue/command.sh, after compiling the INT8 batch pass's per-row work for
# AVX-512 where the products run on AVX-512 VNNI or AMX, and giving the F32 CpuPolicy's
# batches four rows per pass (its tests, mlp_cpu, run here too, for the AVX-512 kernel), and
# after the review pass's AMX changes (one tile sequence for paired and unpaired blocks,
# nested Tiles):
# fx-quant's INT8 tests on the host's CPU (AMX, every ISA against the scalar reference), the
# timing printouts (products alone; layouts, batch 1 to 256), then three fx / PyTorch pairs of
# CPU decision benches. Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
lscpu > $W/cpu/cpu.txt 2>&1
timeout 240 bash .gpu/run.sh tests gemv_i8 policy:: tft::tests guard mamba2 mlp_cpu --test-threads 8 > $W/tests.log 2>&1
timeout 150 bash .gpu/run.sh tests timing_products_of_32_rows int8_layouts --ignored --nocapture --test-threads 1 > $W/timing.log 2>&1
for k in 1 2 3; do
  timeout 100 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 100 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
tar czf $O/all.tgz -C $W .
