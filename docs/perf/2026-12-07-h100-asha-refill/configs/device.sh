#!/usr/bin/env bash
# Device command of the gemm-epilogue + ASHA-refill record: the new and touched GPU tests
# (cuBLASLt epilogue, DQN fused, the population collector with a member clock, the
# optimiser's decide kernel with inactive members, the DQN population that replaces a
# member, every population test), the PPO seed replay; a 256-trial DQN sweep with [halving]
# in 64 slots (a freed slot takes the next trial); then the pop + dqn BF16 bench with
# FX_GEMM_EPILOGUE=0 (before) and =1 (after), the latter with bench.py through
# scripts/gpu-bench.sh.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
bash $G/unpack.sh > /dev/null || { echo "unpack failed"; exit 1; }
bash $G/run.sh env > "$L/env.txt" 2>&1; head -2 "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64 FX_GEMM_EPILOGUE=1
t() { # name timeout filter...
  local name=$1 to=$2; shift 2
  timeout "$to" bash $G/run.sh tests "$@" > "$L/tests-$name.log" 2>&1
  echo "$name: rc=$? $(grep -c '^test .* ok$' "$L/tests-$name.log") ok, $(grep -c '^test .* FAILED$' "$L/tests-$name.log") failed, at $(el) s"
  grep -hE "panicked|^test .* FAILED$|rel err .*e-0[0-4]" "$L/tests-$name.log" | head -8
}
t lt 60 blas_lt --nocapture
t dqn-fused 120 dqn::fused dqn::pop_fused --nocapture
FX_TEST_SEED=1796648650758566212 t ppo-seed 60 ppo::pop_fused::tests::member_gradients --nocapture
grep -E "tensor [0-9]+ rel err|worst network" "$L/tests-ppo-seed.log" | head -8
t pop 200 pop --nocapture
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
mkdir -p "$L/asha"
S0=$(date +%s.%N)
timeout 150 /tmp/fxgpu/bin/fx-train sweep --config $G/cfg/asha256.toml --out "$L/asha/asha" --members 64 > "$L/asha/sweep.log" 2>&1
echo "asha sweep rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $S0, 2))") s"
grep -E "population of|trained|leaderboard|rror" "$L/asha/sweep.log" | head -8
cp "$L/asha/asha/trials.csv" "$L/asha/" 2>/dev/null; rm -rf "$L/asha/asha/weights" "$L/asha/asha/waves"
echo "asha at $(el) s"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
mkdir -p "$L/before"
FX_GEMM_EPILOGUE=0 timeout 120 /tmp/fxgpu/bin/fx-train bench --model pop,dqn --precision bf16 --json > "$L/before/fx.json" 2> "$L/before/fx.log"
echo "before (FX_GEMM_EPILOGUE=0): rc=$? at $(el) s"
mkdir -p "$L/bench"
OUT=$L/bench FX_TIMEOUT=120 TORCH_TIMEOUT=200 TORCH_BUDGET_S=150 \
  FX_BENCH_ARGS="--model pop,dqn --precision bf16" TORCH_MODELS=pop,dqn bash scripts/gpu-bench.sh 2>&1 | grep -v "^  " | tail -40
cp "$L/bench/fx.json" "$L/bench/torch.json" "$L/bench/compare.md" "$OUT/" 2>/dev/null
python3 scripts/compare.py "$L/before/fx.json" "$L/bench/torch.json" --markdown > "$L/before/compare.md" 2>&1
grep -E "pop|dqn_train" "$L/before/compare.md" | head -20
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs
echo "done at $(el) s"; ls -la "$OUT"
