#!/usr/bin/env bash
# One device call: the CUDA test binaries (FX_REQUIRE_GPU=1); a DQN walk-forward study of
# 3 folds x 4 seeds on the three shipped stocks, as one population and one run after
# another (the binary called directly); then the population bench against bench.py
# --models pop if time is left. Logs tarred after each phase.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
pack() { tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs; }
bash $G/unpack.sh || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout ${TESTS_TIMEOUT:-200} bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log") at $(el) s"
grep -E "^test .* FAILED|^FAILED|panicked|^test result" "$L/tests.log" | head -40
grep -E "^test .*(batched_collection|pop_collection|panel_seq_graph|seq_graph_step|set_member_rewrites|windows_of_a_split)" "$L/tests.log" | head
pack
X=/tmp/fxgpu/bin/fx-train
W=$L/walls.txt; : > "$W"
run() { # name, timeout, args...
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$lim" "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"
}
R=$(mktemp -d)
if [ "$(el)" -lt 300 ]; then
  run study-population ${POP_TIMEOUT:-70} train --config $G/cfg/solo.toml --data $G/shared/data --folds 3 --seeds 4 --population --quiet --out $R/pop
  run study-sequential ${SEQ_TIMEOUT:-110} train --config $G/cfg/solo.toml --data $G/shared/data --folds 3 --seeds 4 --quiet --out $R/seq
  tail -n 8 "$L/study-population.log"; tail -n 8 "$L/study-sequential.log"
  for d in pop seq; do [ -f $R/$d/study.json ] && cp $R/$d/study.json "$L/study-$d.json"; done
  pack
fi
if [ "$(el)" -lt "${BENCH_BEFORE:-330}" ]; then
  mkdir -p "$L/bench"
  OUT=$L/bench FX_TIMEOUT=${FX_TIMEOUT:-70} TORCH_TIMEOUT=${TORCH_TIMEOUT:-100} TORCH_BUDGET_S=80 \
    FX_BENCH_ARGS="--model pop" TORCH_MODELS=pop bash scripts/gpu-bench.sh 2>&1 | tail -30
  cp "$L/bench/fx.json" "$L/bench/torch.json" "$L/bench/compare.md" "$OUT/" 2>/dev/null
else
  echo "bench skipped: $(el) s elapsed"
fi
pack
echo "device.sh done at $(el) s"
ls -la "$OUT"
