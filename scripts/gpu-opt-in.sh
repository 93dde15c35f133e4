#!/usr/bin/env bash
# The device checks and measurements that decide fx's opt-in GPU paths:
#   FX_POP_ITERATION_GRAPH=1   a DQN population's whole iteration as one graph
#   FX_GEMM_EPILOGUE=1         the trunk GEMMs' bias + ReLU in cuBLASLt's epilogue
#   FX_GEMM_EPILOGUE=split     BF16-output GEMMs, then the bias + activation kernel on BF16
# Stage here (no GPU needed), binaries of one commit in one xz tarball (candle's PTX
# repeats in every binary and compresses once):
#   . ../shared/gpu/cuda-env.sh
#   FX_GPU_OUT=/tmp/pk ../shared/gpu/pack tests --release -p fx-kernels -p fx-models -p fx-precision --features cuda --lib
#   ../shared/gpu/cuda-cargo build --release -p fx-train --features cuda; git checkout Cargo.lock
#   (zcat each /tmp/pk/tests/fx_{kernels,models,precision}-*.gz to fxk, fxm, fxp; copy
#   release/fx-train; strip all four) then: tar -c fxk fxm fxp fx-train | xz -9
#   --lzma2=dict=512MiB -T2 > .gpu/bins.tar.xz; and ../shared/gpu/pack's .gpu/shared.
# Then ON the device, from the repo root, one part per call:
#   OUT=/path/to/out bash scripts/gpu-opt-in.sh checks    # GPU tests, ~4 min
#   OUT=/path/to/out bash scripts/gpu-opt-in.sh measure   # sweeps, bench A/B, ncu, ~5 min
# checks: the cuBLASLt support matrix (blas_lt heuristic test); GPU tests of fx-kernels (pop,
#   blas), fx-precision (pop), fx-models (population, fused, train_cuda); the DQN population
#   tests again under FX_POP_ITERATION_GRAPH=1 (every GPU population test through the
#   iteration graph); the fused DQN/PPO tests under FX_GEMM_EPILOGUE=split and =1.
# measure: the 256-trial ASHA sweep (64 slots) and the plain 256-trial sweep with iteration
#   graphs off and on (one binary, one card), one default run, fx's pop bench under
#   FX_GEMM_EPILOGUE=0 and split (fx only: a PERFORMANCE row needs scripts/gpu-bench.sh),
#   then ncu's per-kernel times of the pop bench (bf16, 5 steps).
set -u
OUT=${OUT:-results}; mkdir -p "$OUT"
G=${FX_GPU_DIR:-.gpu}
X=/tmp/fx-opt-in; mkdir -p $X
[ -x $X/fx-train ] || xz -dc "$G/bins.tar.xz" | tar -x -C $X
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/env.txt"
R=$(pwd)
CFG=docs/perf/2026-12-07-h100-wave-resume/configs
ASHA=docs/perf/2026-12-07-h100-asha-refill/configs/asha256.toml
t() { local name=$1 dir=$2 to=$3; shift 3; local s=$(date +%s)
  (cd "$dir" && timeout $to "$@" > "$R/$OUT/$name.log" 2>&1); echo "$name rc=$? $(( $(date +%s) - s )) s"
  grep -E "^test result|FAILED|panicked" "$R/$OUT/$name.log" | head -8; }
sw() { local name=$1 cfg=$2; shift 2; local s=$(date +%s.%N)
  timeout 90 $X/fx-train sweep --config "$cfg" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
  grep -iE "busy|trained|whole-iteration|rror" "$OUT/$name.log" | head -4
  rm -rf "$OUT/$name/weights" "$OUT/$name/tensorboard" "$OUT/$name/waves" "$OUT/$name/trials"; }
case "${1:-checks}" in
  checks)
    t lt-support crates/fx-kernels 40 $X/fxk blas_lt::tests::heuristic --nocapture
    grep "lt support" "$OUT/lt-support.log"
    t fxk-pop-blas crates/fx-kernels 60 $X/fxk pop blas
    t fxp-pop crates/fx-precision 40 $X/fxp pop
    t fxm-pop-fused crates/fx-models 200 $X/fxm population fused train_cuda --nocapture
    grep -E "iteration graph vs stepwise|worst network gradient|epilogue vs unfused" "$OUT/fxm-pop-fused.log" | head -20
    FX_POP_ITERATION_GRAPH=1 t fxm-dqn-pop-iter crates/fx-models 120 $X/fxm dqn::population --nocapture
    for e in split 1; do
      FX_GEMM_EPILOGUE=$e t fxm-fused-epi-$e crates/fx-models 120 $X/fxm dqn::fused dqn::pop_fused ppo::pop_fused train_cuda --nocapture
      grep -E "epilogue vs unfused|worst network gradient" "$OUT/fxm-fused-epi-$e.log" | head -10
    done ;;
  measure)
    for it in 0 1; do
      FX_POP_ITERATION_GRAPH=$it sw asha256-iter$it $ASHA --members=64
      FX_POP_ITERATION_GRAPH=$it sw sweep256-iter$it $CFG/sweep256.toml
    done
    s=$(date +%s.%N); timeout 60 $X/fx-train train --config $CFG/solo.toml --quiet --out "$OUT/solo" > "$OUT/solo.log" 2>&1
    echo "solo rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"; rm -rf "$OUT/solo/weights" "$OUT/solo/tensorboard"
    for e in 0 split; do
      FX_GEMM_EPILOGUE=$e timeout 120 $X/fx-train bench --model pop --precision bf16 --json > "$OUT/bench-pop-$e.json" 2> "$OUT/bench-pop-$e.log"
      echo "bench pop epilogue=$e rc=$?"; grep -E "pop" "$OUT/bench-pop-$e.log" | tail -4
    done
    timeout 110 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      $X/fx-train bench --model pop --precision bf16 --steps 5 --device cuda > "$OUT/ncu-pop.csv" 2> "$OUT/ncu-pop.log"
    echo "ncu rc=$? rows $(wc -l < "$OUT/ncu-pop.csv")" ;;
  *) echo "usage: bash scripts/gpu-opt-in.sh checks|measure" >&2; exit 2 ;;
esac
