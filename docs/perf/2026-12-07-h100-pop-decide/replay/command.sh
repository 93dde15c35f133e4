#!/usr/bin/env bash
# Replays the failing seeds of the 2026-12-07 pop-decide command (FX_TEST_SEED) on main's
# test binaries and, for the PBT test, on those of 1a638c8 (before fx_pop_decide was used),
# then runs the PBT test on fresh seeds with both to compare how often each fails.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
mkdir -p /tmp/fxgpu && xz -dc $G/replay.tar.xz | tar -x -C /tmp/fxgpu && chmod +x /tmp/fxgpu/*/*
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
BR=$(cat $G/BUILD_ROOT); [ -e "$BR" ] || { mkdir -p "$(dirname "$BR")"; ln -s "$PWD" "$BR"; }
for p in "$(dirname "$BR")/shared" "$(dirname "$PWD")/shared"; do [ -e "$p" ] || ln -s "$PWD/$G/shared" "$p"; done
NEW=/tmp/fxgpu/tests/fx_models-18a6ef78697009cd; OLD=/tmp/fxgpu/old/fx_models-old
PREC=/tmp/fxgpu/tests/fx_precision-d173ed213b5f6558
PBT=dqn::population::tests::pbt_moves_reach_the_captured_update
t() { local name=$1 bin=$2 seed=$3 test=$4; (cd "$BR/crates/${5:-fx-models}" && FX_TEST_SEED=$seed timeout 60 "$bin" "$test" --exact --nocapture > "$L/$name.log" 2>&1); local rc=$?
  echo "$name rc=$rc $(grep -E 'rel err|panicked|test result' "$L/$name.log" | tail -2 | tr '\n' ' ')"; }
t pbt-new-failseed $NEW 1796648697840139971 $PBT
t pbt-old-failseed $OLD 1796648697840139971 $PBT
t pbt-new-failseed-again $NEW 1796648697840139971 $PBT
t ppo-new-failseed $NEW 1796648650758566212 ppo::pop_fused::tests::member_gradients_match_the_cpu_reference
t decide-new-failseed $PREC 1796648649886715644 fused::pop_kernel_tests::pop_decide_matches_reference fx-precision
for i in 1 2 3 4 5 6 7 8 9 10; do s=$((1796700000000000000 + i * 7919)); t pbt-new-$i $NEW $s $PBT; t pbt-old-$i $OLD $s $PBT; done
for bin in tests/fx_precision-d173ed213b5f6558 tests/fx_models-18a6ef78697009cd; do
  d=fx-models; case $bin in *precision*) d=fx-precision;; esac
  (cd "$BR/crates/$d" && timeout 120 /tmp/fxgpu/$bin > "$L/full-$(basename $bin).log" 2>&1); echo "full $(basename $bin) rc=$? $(grep -E '^test result|FAILED' "$L/full-$(basename $bin).log" | head -3 | tr '\n' ' ')"
done
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
