#!/usr/bin/env bash
# The second device command of 2026-12-02 (session 10; AMX tiles configured for every product), run from the repo root on the H200
# machine with .gpu/ packed (tests: the fx-kernels and fx-quant libs; bin: release/fx-train):
# on the host's CPU, fx-quant's INT8 tests (the AMX tile kernel and the policies against the
# scalar reference, where the CPU has AMX), the INT8 layouts' timing printout (row-major,
# AVX-512 VNNI interleaved, AMX; batch 1 to 256), then three fx / PyTorch pairs of CPU
# decision benches (fx-train bench --device cpu, bench.py --cpu --threads 1 with its
# int8_dynamic mode). Output in $OUT/w.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
lscpu > $W/cpu/cpu.txt 2>&1
grep -o 'amx[a-z0-9_]*\|avx512_vnni\|avx_vnni' /proc/cpuinfo | sort | uniq -c > $W/cpu/flags.txt
timeout 240 bash .gpu/run.sh tests gemv_i8 policy:: tft::tests guard --test-threads 8 > $W/tests.log 2>&1
timeout 120 bash .gpu/run.sh tests int8_layouts --ignored --nocapture > $W/timing.log 2>&1
for k in 1 2 3; do
  timeout 100 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 100 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
tar czf $O/all.tgz -C $W .
