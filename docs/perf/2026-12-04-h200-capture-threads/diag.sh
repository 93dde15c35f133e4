#!/usr/bin/env bash
# Concurrent-capture diagnosis: graph_gpu on the default (parallel) harness, repeated.
set -u
export FX_REQUIRE_GPU=1
for mode in default EAGER; do
  for i in 1 2 3 4 5 6; do
    if [ $mode = EAGER ]; then export CUDA_MODULE_LOADING=EAGER; else unset CUDA_MODULE_LOADING; fi
    timeout 120 bash .gpu/run.sh tests > "$OUT/$mode-$i.log" 2>&1
    echo "$mode $i rc=$? $(grep 'test result' "$OUT/$mode-$i.log") $(grep -c FAILED "$OUT/$mode-$i.log")"
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
