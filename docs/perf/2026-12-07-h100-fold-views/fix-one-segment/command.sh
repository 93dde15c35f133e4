#!/usr/bin/env bash
# Third device call of the fold-views record: the fx-kernels CUDA tests after the fix of a
# one-segment view's reset (the kernel reset over the whole rows, not inside the segment).
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
bash $G/unpack.sh > /dev/null || { echo "unpack failed"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 90 bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log")"; grep -E "FAILED|panicked|^test result|fold_views" "$L/tests.log" | head
