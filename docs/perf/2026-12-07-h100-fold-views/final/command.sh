#!/usr/bin/env bash
# Second device call of the fold-views record, with the final fx-train (the data read once,
# par_map scoring): the fx-kernels CUDA tests, the 40-run population study (twice) and the
# 500-instrument panel's 5-fold population study with the device memory sampled.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
bash $G/unpack.sh > /dev/null || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
X=/tmp/fxgpu/bin/fx-train
timeout 90 bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log") at $(el) s"; grep -E "FAILED|panicked|^test result" "$L/tests.log" | head
W=$L/walls.txt; touch "$W"
run() { local name=$1 lim=$2; shift 2; local t0=$(date +%s%N)
  timeout "$lim" "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"; }
R=$(mktemp -d)
run study40-population 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop
run study40-population-again 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop2
grep -h "views of one copy\|trained in\|study of 40" "$L"/study40-population-again.log
P=/tmp/panel; mkdir -p $P
/tmp/fxgpu/bin/write_panel_parquet $P/panel500.parquet 500 5040 1 > "$L/panel-parquet.log" 2>&1
run panel-features 90 features --input $P/panel500.parquet --output $P/panel500.safetensors
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$L/panel-mem.txt" 2>&1 &
SMI=$!
run panel-study5 150 train --config $G/cfg/panel.toml --data $P/panel500.safetensors --folds 5 --seeds 1 --population --quiet --out $R/panel
kill $SMI 2>/dev/null
sort -n "$L/panel-mem.txt" | tail -n 1 | sed 's/^/peak MiB used: /'
grep -h "views of one copy\|trained in" "$L/panel-study5.log"
echo "done at $(el) s"
