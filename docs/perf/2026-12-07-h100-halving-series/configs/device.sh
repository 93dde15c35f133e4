#!/usr/bin/env bash
# One device call. PHASE=main: the CUDA test binaries (FX_REQUIRE_GPU=1, GPU binaries first);
# a DQN walk-forward study of 5 folds x 8 seeds on the three shipped stocks as one population
# and one run after another; a 64-trial DQN sweep with and without [halving] (the binary
# called directly, walls without unpacking). PHASE=bench: scripts/gpu-bench.sh with the
# population cases against bench.py --models pop. Logs tarred after each phase.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
pack() { tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs; }
bash $G/unpack.sh || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
X=/tmp/fxgpu/bin/fx-train
W=$L/walls.txt; touch "$W"
run() { # name, timeout, args...
  local name=$1 lim=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$lim" "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"
}
R=$(mktemp -d)
if [ "${PHASE:-main}" = main ]; then
  if [ -n "${FIRST:-}" ]; then
    timeout 90 bash $G/run.sh tests $FIRST > "$L/tests-first.log" 2>&1
    echo "first tests ($FIRST): $(tail -n 1 "$L/tests-first.log") at $(el) s"
    grep -E "^test .* (ok|FAILED)$|panicked" "$L/tests-first.log" | head -20
  fi
  timeout ${TESTS_TIMEOUT:-260} bash $G/run.sh tests > "$L/tests.log" 2>&1
  echo "tests: $(tail -n 1 "$L/tests.log") at $(el) s"
  grep -E "^test .* FAILED|^FAILED|panicked|^test result|^=== " "$L/tests.log" | head -60
  grep -E "^test .*(retained|envs_of_one_series|panel_seq_graph|set_member_rewrites|batched_collection|lookups_beside)" "$L/tests.log" | head
  pack
  run study40-population ${POP_TIMEOUT:-80} train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop
  run study40-sequential ${SEQ_TIMEOUT:-150} train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --quiet --out $R/seq
  tail -n 6 "$L/study40-population.log"; tail -n 6 "$L/study40-sequential.log"
  for d in pop seq; do [ -f $R/$d/study.json ] && cp $R/$d/study.json "$L/study40-$d.json"; done
  pack
  run sweep64-plain ${SWEEP_TIMEOUT:-60} sweep --config $G/cfg/sweep64.toml --out $R/s64
  run sweep64-halving ${SWEEP_TIMEOUT:-60} sweep --config $G/cfg/sweep64-halving.toml --out $R/s64h
  grep -h "trained .* trials in\|halving at\|GPU busy" "$L"/sweep64-*.log | head
  # Configs sized beyond the card: a one-line refusal (or a caught allocation error), never an abort.
  [ -n "${HUGE:-1}" ] && [ "${HUGE:-1}" = 1 ] && run huge-replay 60 train --config $G/cfg/huge-replay.toml --data $G/shared/data/msft_daily_2000_2013.csv --out $R/h1
  [ "${HUGE:-1}" = 1 ] && run huge-net 60 train --config $G/cfg/huge-net.toml --data $G/shared/data/msft_daily_2000_2013.csv --out $R/h2
  tail -n 3 "$L/huge-replay.log" "$L/huge-net.log"
  for d in s64 s64h; do mkdir -p "$L/$d"; for f in trials.csv sweep.json population.json; do [ -f "$R/$d/$f" ] && cp "$R/$d/$f" "$L/$d/"; done; done
fi
if [ "${PHASE:-main}" = bench ]; then
  mkdir -p "$L/bench"
  OUT=$L/bench FX_TIMEOUT=${FX_TIMEOUT:-90} TORCH_TIMEOUT=${TORCH_TIMEOUT:-150} TORCH_BUDGET_S=120 \
    FX_BENCH_ARGS="--model pop" TORCH_MODELS=pop bash scripts/gpu-bench.sh 2>&1 | tail -40
  cp "$L/bench/fx.json" "$L/bench/torch.json" "$L/bench/compare.md" "$OUT/" 2>/dev/null
fi
pack
echo "device.sh done at $(el) s"
ls -la "$OUT"
