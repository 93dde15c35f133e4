#!/usr/bin/env bash
# Device command: unpack the xz pack, GPU tests of the packed binaries, then timed sweeps and
# solo runs (the binary called directly, so the walls hold no unpacking); one tarball back.
set -u
OUT=${OUT:-results}; R=$(mktemp -d); L=$R/logs; mkdir -p "$L"
G=.gpu
bash $G/unpack.sh || { echo "unpack failed"; exit 1; }
bash $G/run.sh env > "$L/env.txt" 2>&1; head -2 "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
t0=$(date +%s)
timeout 330 bash $G/run.sh tests > "$L/tests.log" 2>&1
echo "tests: $(tail -n 1 "$L/tests.log") in $(($(date +%s) - t0)) s"
grep -E "^test .* FAILED|panicked|^test result" "$L/tests.log" | head -30
grep -E "^test .*(batched_collection|pop_collection|pbt_moves|pop_)" "$L/tests.log" | head
X=/tmp/fxgpu/bin/fx-train
W=$L/walls.txt; : > "$W"
run() { # name, args...
  local name=$1; shift
  local t0=$(date +%s%N)
  timeout 200 "$X" "$@" > "$L/$name.log" 2>&1; local rc=$?
  local t1=$(date +%s%N)
  local ms=$(( (t1 - t0) / 1000000 )); printf '%s rc=%s wall=%d.%03d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) | tee -a "$W"
}
run solo-1 train --config $G/cfg/solo.toml --quiet --out $R/solo1
run solo-2 train --config $G/cfg/solo.toml --quiet --out $R/solo2
run sweep64-1 sweep --config $G/cfg/sweep64.toml --out $R/s64a
run sweep64-2 sweep --config $G/cfg/sweep64.toml --out $R/s64b
run sweep256-1 sweep --config $G/cfg/sweep256.toml --out $R/s256a
run sweep256-2 sweep --config $G/cfg/sweep256.toml --out $R/s256b
run sweep64-pbt sweep --config $G/cfg/sweep64-pbt.toml --out $R/s64p
run solo-3 train --config $G/cfg/solo.toml --quiet --out $R/solo3
grep -h "trained .* trials in\|GPU busy\|^time:" "$L"/*.log | head -30
for d in s64a s64b s256a s256b s64p solo1 solo2 solo3; do
  mkdir -p "$L/$d"
  for f in trials.csv sweep.json population.json report.json; do [ -f "$R/$d/$f" ] && cp "$R/$d/$f" "$L/$d/"; done
done
cmp -s "$R/s64a/trials.csv" "$R/s64b/trials.csv" && echo "sweep64 trials.csv identical across the two runs" || echo "sweep64 trials.csv DIFFER"
tar -C "$R" -czf "$OUT/logs.tar.gz" logs
ls -la "$OUT"
