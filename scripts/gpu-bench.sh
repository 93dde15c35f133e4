#!/usr/bin/env bash
# fx vs PyTorch on the GPU in one device call: `fx-train bench --json`, then the reference
# bench.py (DQN, PPO, env; all its modes: eager_fp32/eager_bf16/graph_bf16/compile_bf16/
# compile_ro_bf16), then the ratio table (scripts/compare.py).
#
# Build and pack first, here (no GPU needed):
#   ../shared/gpu/cuda-cargo build --release -p fx-train --features cuda
#   ../shared/gpu/pack bin release/fx-train
# Then ON the H200, from the repo root (with .gpu/ copied along):
#   OUT=/path/to/out bash scripts/gpu-bench.sh          # $OUT defaults to results/
# FX_GPU_DIR=.gpu-other uses a pack made with FX_GPU_OUT=$PWD/.gpu-other (default .gpu);
# FX_BENCH_ARGS adds flags to fx-train bench (e.g. --quick for a smoke test, --model tft,mamba2);
# TORCH_MODELS is bench.py's --models (default dqn,ppo,env; e.g. tft,mamba2 to match).
# Writes $OUT/fx.json, fx.log (progress), torch.json, torch.log, compare.md, env.txt.
# Expected device time: ~16 s PTX JIT on a fresh machine + ~30-60 s fx + ~80-100 s torch
# (its compile cases ~45 s); each part has a timeout so the whole stays under ~7 minutes.
set -uo pipefail
export FX_REQUIRE_GPU=1
OUT=${OUT:-results}
mkdir -p "$OUT"
FX_TIMEOUT=${FX_TIMEOUT:-180}
TORCH_TIMEOUT=${TORCH_TIMEOUT:-240}
G=${FX_GPU_DIR:-.gpu}

# (not `run.sh env`: every run.sh call unpacks all packed binaries again)
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv \
  >"$OUT/env.txt" 2>&1 || true

t0=$(date +%s)
timeout "$FX_TIMEOUT" bash "$G/run.sh" bin fx-train bench --json ${FX_BENCH_ARGS:-} >"$OUT/fx.json" 2>"$OUT/fx.log"
fx_rc=$?
t1=$(date +%s)
echo "fx-train bench: rc=$fx_rc in $((t1 - t0)) s (exit 1 = some case failed, 124 = timeout)"
tail -n 30 "$OUT/fx.log"

# --budget-s: compile cases that would start after this many seconds are reported as
# skipped (the dqn/ppo/env compile cases take ~45 s of the run here).
PYTHONUNBUFFERED=1 timeout "$TORCH_TIMEOUT" python3 "$G/shared/reference/bench.py" \
  --models "${TORCH_MODELS:-dqn,ppo,env}" --budget-s "${TORCH_BUDGET_S:-180}" --out "$OUT/torch.json" >"$OUT/torch.log" 2>&1
th_rc=$?
t2=$(date +%s)
echo "bench.py: rc=$th_rc in $((t2 - t1)) s"
tail -n 40 "$OUT/torch.log"

if [ -s "$OUT/fx.json" ] && [ -s "$OUT/torch.json" ]; then
  python3 scripts/compare.py "$OUT/fx.json" "$OUT/torch.json" --markdown | tee "$OUT/compare.md"
else
  echo "compare skipped: fx.json or torch.json is missing or empty"
fi
echo "gpu-bench: fx rc=$fx_rc, torch rc=$th_rc, total $(($(date +%s) - t0)) s"
[ "$fx_rc" = 0 ] && [ "$th_rc" = 0 ]
