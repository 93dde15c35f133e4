#!/usr/bin/env bash
# Device command of the wave-resume record: the population GPU tests (the restored
# populations among them), a 64-trial DQN sweep straight and stopped by SIGTERM inside its
# wave then resumed (rows compared), two default runs and a 256-trial sweep (walls, GPU busy).
set -u
OUT=${OUT:-results}; R=$(mktemp -d); L=$OUT/logs; mkdir -p "$L"
G=.gpu
bash $G/unpack.sh > /dev/null || { echo "unpack failed"; exit 1; }
bash $G/run.sh env > "$L/env.txt" 2>&1; head -2 "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
t0=$(date +%s)
timeout 150 bash $G/run.sh tests population > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log") in $(($(date +%s) - t0)) s"
grep -E "^test .* FAILED|panicked|^test result|restored" "$L/tests.log" | head -20
# The PBT test's GPU-vs-CPU measure at its two recorded failing seeds and four more.
for s in 1796648697840139971 1796700000000015838 1 2 3 4; do
  FX_TEST_SEED=$s timeout 60 bash $G/run.sh tests pbt_moves_reach_the_captured_update --nocapture >> "$L/pbt-seeds.log" 2>&1
done
grep -E "seed [0-9]+ \(|: rel err|^test result|panicked" "$L/pbt-seeds.log" | grep -E "seed|test result|panicked|member 1 target|member 2 online" | head -60
X=/tmp/fxgpu/bin/fx-train
W=$L/walls.txt; : > "$W"
wall() { # name, args...
  local name=$1; shift
  local t0=$(date +%s%N)
  timeout 150 "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 )); printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"
}
wall solo-1 train --config $G/cfg/solo.toml --quiet --out $R/solo1
wall solo-2 train --config $G/cfg/solo.toml --quiet --out $R/solo2
wall sweep64-straight sweep --config $G/cfg/sweep64.toml --out $R/s64a
# The same sweep stopped by SIGTERM at env step 1000 of its one wave, then resumed.
t0=$(date +%s%N)
"$X" sweep --config $G/cfg/sweep64.toml --out $R/s64b > "$L/sweep64-stopped.log" 2>&1 &
pid=$!
( sleep 150; kill -9 $pid 2>/dev/null ) & dog=$!
for i in $(seq 1 1200); do grep -q "env step 1000/2000" "$L/sweep64-stopped.log" && break; sleep 0.05; done
kill -TERM $pid; wait $pid; rc=$?; kill $dog 2>/dev/null
ms=$(( ($(date +%s%N) - t0) / 1000000 )); echo "sweep64-stopped rc=$rc wall=$((ms / 1000)).$((ms % 1000)) s" | tee -a "$W"
ls -la $R/s64b/waves/ | tee -a "$W"
wall sweep64-resumed sweep --config $G/cfg/sweep64.toml --out $R/s64b
cmp -s "$R/s64a/trials.csv" "$R/s64b/trials.csv" && echo "sweep64 resumed trials.csv IDENTICAL to the straight one" | tee -a "$W" || echo "sweep64 resumed trials.csv DIFFER" | tee -a "$W"
wall sweep256 sweep --config $G/cfg/sweep256.toml --out $R/s256
grep -h "trained .* trials in\|GPU busy\|^time:\|checkpointed\|go on from\|interrupted" "$L"/*.log | head -30
for d in s64a s64b s256 solo1 solo2; do
  mkdir -p "$L/$d"
  for f in trials.csv sweep.json population.json report.json; do [ -f "$R/$d/$f" ] && cp "$R/$d/$f" "$L/$d/"; done
done
ls -la "$OUT"
