#!/usr/bin/env bash
# One device call for issue 30's one device copy of a study's data: the fx-kernels and
# fx-models CUDA tests (FX_REQUIRE_GPU=1), the env bench pair (plain and view cases) with
# bench.py's env cases, the 40-run population study of the three stocks (twice: the first
# pays the PTX load) and one after another, and a 500-instrument panel study (5 folds) with
# the device's memory sampled.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
bash $G/unpack.sh || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
nproc > "$L/nproc.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
X=/tmp/fxgpu/bin/fx-train
timeout 150 bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log") at $(el) s"
grep -E "^test .* FAILED|^FAILED|panicked|^test result|^=== " "$L/tests.log" | head -40
grep -E "fold_views|pop_collection|segmented|share" "$L/tests.log" | head
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
mkdir -p "$L/bench"
OUT=$L/bench FX_TIMEOUT=90 TORCH_TIMEOUT=120 TORCH_BUDGET_S=60 \
  FX_BENCH_ARGS="--model env" TORCH_MODELS=env bash scripts/gpu-bench.sh 2>&1 | tail -25
cp "$L/bench/fx.json" "$L/bench/torch.json" "$L/bench/compare.md" "$OUT/" 2>/dev/null
echo "bench at $(el) s"
W=$L/walls.txt; touch "$W"
run() { local name=$1 lim=$2; shift 2; local t0=$(date +%s%N)
  timeout "$lim" "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"; }
R=$(mktemp -d)
run study40-population 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop
run study40-population-again 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop2
run study40-sequential 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --quiet --out $R/seq
for d in pop seq; do [ -f $R/$d/study.json ] && cp $R/$d/study.json "$L/study40-$d.json"; done
grep -h "trained\|study of\|views of one copy" "$L"/study40-*.log | head
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
echo "studies at $(el) s"
# The 500-instrument panel: Parquet, features, then a 5-fold population study with the
# device memory sampled every 50 ms (nvidia-smi, MiB).
P=/tmp/panel; mkdir -p $P
/tmp/fxgpu/bin/write_panel_parquet $P/panel500.parquet 500 5040 1 > "$L/panel-parquet.log" 2>&1
run panel-features 90 features --input $P/panel500.parquet --output $P/panel500.safetensors
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$L/panel-mem.txt" 2>&1 &
SMI=$!
run panel-study5 150 train --config $G/cfg/panel.toml --data $P/panel500.safetensors --folds 5 --seeds 1 --population --quiet --out $R/panel
kill $SMI 2>/dev/null
sort -n "$L/panel-mem.txt" | tail -n 1 | sed 's/^/peak MiB used: /'
head -n 1 "$L/panel-mem.txt" | sed 's/^/first sample MiB: /'
grep -h "views of one copy\|population of\|trained" "$L/panel-study5.log" | head
tail -n 5 "$L/panel-study5.log"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
echo "done at $(el) s"; ls -la "$OUT"
