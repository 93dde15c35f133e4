#!/usr/bin/env bash
# Device tests and profiled training runs on the GPU, in one device call (after
# `../shared/gpu/pack tests ...` and `pack bin release/fx-train` here):
#   OUT=/path/to/out bash scripts/gpu-runs.sh [tests] [runs]     # default: both
# tests: every packed test binary (`.gpu/run.sh tests`, the default harness: tests run on
#        parallel threads), then the resident-kernel MlpServer tests alone (`server
#        --ignored --test-threads=1` in fx-models, as MlpServer's docs require); logs in
#        $OUT/tests.log and $OUT/server.log. FX_REQUIRE_GPU=1: a GPU test without a GPU fails.
# runs:  DQN, PPO (default configs, --device cuda) and TFT (one epoch) with their report's
#        profile (GPU busy fraction) and report.json appended to $OUT/runs.log.
#        RUN_SPECS replaces the list: `name:model:flags` entries separated by `;`, e.g.
#        RUN_SPECS="dqn:dqn:--steps 3000;dqn-b256:dqn:--steps 3000 --batch-size 256".
set -uo pipefail
export FX_REQUIRE_GPU=1
OUT=${OUT:-results}
mkdir -p "$OUT"
G=${FX_GPU_DIR:-.gpu}
what=${*:-tests runs}
rc=0
if [[ " $what " == *" tests "* ]]; then
  t0=$(date +%s)
  timeout "${TESTS_TIMEOUT:-300}" bash "$G/run.sh" tests >"$OUT/tests.log" 2>&1 || rc=1
  echo "tests: $(tail -n 1 "$OUT/tests.log") in $(($(date +%s) - t0)) s"
  grep -E "^test .* FAILED|^FAILED|panicked" "$OUT/tests.log" | head -20
  # run.sh unpacked the binaries to /tmp/fxgpu/tests and recreated the build root's path.
  G_ABS=$(cd "$G" && pwd)
  BR=$(cat "$G_ABS/BUILD_ROOT" 2>/dev/null || pwd)
  kern=$(awk '$2 == "crates/fx-models" && $1 ~ /^fx_models-/ {print $1; exit}' "$G_ABS/tests.txt")
  if [ -n "$kern" ]; then
    (cd "$BR/crates/fx-models" && timeout 120 /tmp/fxgpu/tests/"$kern" mlp::cuda::tests::server --ignored --test-threads=1) \
      >"$OUT/server.log" 2>&1 || rc=1
    echo "server tests: $(grep -E '^test result' "$OUT/server.log" | tail -n 1)"
  else
    echo "server tests: no fx-models test binary packed"; rc=1
  fi
fi
if [[ " $what " == *" runs "* ]]; then
  R=$(mktemp -d)
  : >"$OUT/runs.log"
  IFS=';' read -r -a specs <<<"${RUN_SPECS:-dqn:dqn:--steps 3000;ppo:ppo:--steps 3000;tft:tft:--epochs 1}"
  for spec in "${specs[@]}"; do
    name=${spec%%:*} rest=${spec#*:}
    model=${rest%%:*} args=
    [[ $rest == *:* ]] && args=${rest#*:}  # "name:model" without flags has none
    echo "=== $name: fx-train train --model $model $args --device cuda" >>"$OUT/runs.log"
    t0=$(date +%s)
    timeout "${RUN_TIMEOUT:-120}" bash "$G/run.sh" bin fx-train train --model "$model" $args \
      --device cuda --quiet --out "$R/$name" >>"$OUT/runs.log" 2>&1 || { rc=1; echo "FAILED: $name" >>"$OUT/runs.log"; }
    echo "($name: $(($(date +%s) - t0)) s)" >>"$OUT/runs.log"
    if [ -f "$R/$name/report.json" ]; then
      echo "--- $name report.json" >>"$OUT/runs.log"
      cat "$R/$name/report.json" >>"$OUT/runs.log"
    fi
    [ -f "$R/$name/metrics.jsonl" ] && { echo "--- $name metrics.jsonl (last 3)"; tail -n 3 "$R/$name/metrics.jsonl"; } >>"$OUT/runs.log"
  done
  grep -E "^===|^batch |GPU busy|time:|beat|FAILED|error" "$OUT/runs.log"
fi
exit $rc
