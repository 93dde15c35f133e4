#!/usr/bin/env bash
# Command 3 of 2026-12-02 (session 7), from the repo root on the H200 with .gpu/ packed (bin:
# release/fx-train, now with the fused_graph_bf16 TFT forecast mode): the GPU bench of the TFT,
# fx and bench.py in one go (scripts/gpu-bench.sh). Output in $OUT/g.
set -u
O=${OUT:-results}
OUT=$O/g FX_BENCH_ARGS="--model tft" TORCH_MODELS=tft FX_TIMEOUT=200 TORCH_TIMEOUT=200 TORCH_BUDGET_S=150 \
  bash scripts/gpu-bench.sh > $O/gpu-bench.log 2>&1
tar czf $O/all.tgz -C $O g gpu-bench.log
