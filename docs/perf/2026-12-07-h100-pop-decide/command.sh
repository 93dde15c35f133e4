#!/usr/bin/env bash
# One device call for the fx_pop_decide wiring: the fx-precision and fx-models CUDA test
# binaries (FX_REQUIRE_GPU=1), then the population bench of the fx-train before it (43c411d,
# fx-train-old.xz) and after, and bench.py --models pop, all on this machine.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
bash $G/unpack.sh || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
# The decide kernel's own test and the population tests first (fast answers), then all.
timeout 120 bash $G/run.sh tests pop > "$L/tests-pop.log" 2>&1
echo "pop tests: $(tail -n 1 "$L/tests-pop.log") at $(el) s"
grep -E "^test .* (ok|FAILED)$|panicked|^test result" "$L/tests-pop.log" | grep -v "ignored" | head -40
timeout ${TESTS_TIMEOUT:-240} bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "all tests: $(tail -n 1 "$L/tests.log") at $(el) s"
grep -E "^test .* FAILED|^FAILED|panicked|^test result|^=== " "$L/tests.log" | head -40
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
xz -dc $G/fx-train-old.xz > /tmp/fx-old && chmod +x /tmp/fx-old
mkdir -p "$L/before"
timeout 120 /tmp/fx-old bench --model pop --json > "$L/before/fx.json" 2> "$L/before/fx.log"
echo "before (43c411d): rc=$? at $(el) s"; tail -n 12 "$L/before/fx.log"
mkdir -p "$L/bench"
OUT=$L/bench FX_TIMEOUT=120 TORCH_TIMEOUT=170 TORCH_BUDGET_S=140 \
  FX_BENCH_ARGS="--model pop" TORCH_MODELS=pop bash scripts/gpu-bench.sh 2>&1 | tail -40
cp "$L/bench/fx.json" "$L/bench/torch.json" "$L/bench/compare.md" "$OUT/" 2>/dev/null
python3 scripts/compare.py "$L/before/fx.json" "$L/bench/torch.json" --markdown > "$L/before/compare.md" 2>&1
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
# main's fx-train (its GPU runs now check the device's free memory before allocating):
# runs that fit must still start, configs beyond the card end in one line.
xz -dc $G/fx-train-main.xz > /tmp/fx-main && chmod +x /tmp/fx-main
M=$L/main; mkdir -p "$M"; R=$(mktemp -d)
run() { local name=$1 lim=$2; shift 2; local t0=$(date +%s%N)
  timeout "$lim" /tmp/fx-main "$@" > "$M/$name.log" 2>&1; local rc=$?
  printf '%s rc=%s wall=%d ms\n' "$name" "$rc" $(( ($(date +%s%N) - t0) / 1000000 )) | tee -a "$M/walls.txt"; }
run solo 90 train --config $G/cfg/solo.toml --quiet --out $R/solo
run study40-population 90 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop
run sweep64-plain 90 sweep --config $G/cfg/sweep64.toml --out $R/s64
run huge-replay 60 train --config $G/cfg/huge-replay.toml --data $G/shared/data/msft_daily_2000_2013.csv --out $R/h1
run huge-net 60 train --config $G/cfg/huge-net.toml --data $G/shared/data/msft_daily_2000_2013.csv --out $R/h2
tail -n 3 "$M"/solo.log "$M"/huge-*.log; grep -h "trained .* trials in\|GPU busy" "$M"/sweep64-plain.log | head -3
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
echo "done at $(el) s"; ls -la "$OUT"
