#!/usr/bin/env bash
# One device call: the 40-run DQN study (5 folds x 8 seeds, three stocks) as one population
# and one run after another, with the fx-train of this pack. Walls from date around each.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
mkdir -p /tmp/fxgpu && xz -dc $G/fx-train.xz > /tmp/fxgpu/fx-train && chmod +x /tmp/fxgpu/fx-train
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
nproc > "$L/nproc.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
X=/tmp/fxgpu/fx-train
W=$L/walls.txt; touch "$W"
run() { local name=$1 lim=$2; shift 2; local t0=$(date +%s%N)
  timeout "$lim" "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"; }
R=$(mktemp -d)
run study40-population 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop
run study40-population-again 60 train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --population --quiet --out $R/pop2
run study40-sequential ${SEQ_TIMEOUT:-60} train --config $G/cfg/solo.toml --data $G/shared/data --folds 5 --seeds 8 --quiet --out $R/seq
for d in pop seq; do [ -f $R/$d/study.json ] && cp $R/$d/study.json "$L/study40-$d.json"; done
grep -h "trained\|study of" "$L"/study40-*.log
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
