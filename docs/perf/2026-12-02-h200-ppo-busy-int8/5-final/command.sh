#!/usr/bin/env bash
# The final device command of 2026-12-02 (session 6), run from the repo root on the H200 with
# .gpu/ packed (tests: fx-kernels and fx-quant libs; bin: release/fx-train): device tests,
# profiled runs, a SIGTERM + resume check, CPU benches of fx and bench.py (twice), the MAMBA-2
# step on the CPU. Output in $OUT/w (tests.log, runs.log, ppo20k-intervals.txt, sig-*, cpu/).
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W/cpu
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv > $W/env.txt 2>&1
bash .gpu/run.sh tests readback mlp_cpu gemv_i8 policy mamba2::tests --test-threads 2 > $W/tests.log 2>&1
OUT=$W RUN_SPECS="ppo20k:ppo:--steps 20000;ppo20k-again:ppo:--steps 20000;ppo40k:ppo:--steps 40000;dqn10k:dqn:--steps 10000" bash scripts/gpu-runs.sh runs
R=/tmp/fxr; rm -rf $R; mkdir -p $R
bash .gpu/run.sh bin fx-train train --model ppo --steps 20000 --device cuda --out $R/b > $W/sig-b.log 2>&1
python3 - "$R/b/metrics.jsonl" > $W/ppo20k-intervals.txt <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("gpu_busy_fraction") is not None:
        print(f"elapsed {m['elapsed_s']:.2f} s  env_steps {m['env_steps']}  gpu_busy {m['gpu_busy_fraction']:.3f}")
PY
(bash .gpu/run.sh bin fx-train train --model ppo --steps 20000 --device cuda --out $R/a > $W/sig-a.log 2>&1 &)
for i in $(seq 1 500); do [ -f $R/a/metrics.jsonl ] && [ $(wc -l < $R/a/metrics.jsonl) -ge 120 ] && break; sleep 0.02; done
pkill -TERM -f "out $R/a"; sleep 3
bash .gpu/run.sh bin fx-train train --resume --out $R/a > $W/sig-resume.log 2>&1
python3 -c "import json;a=json.load(open('$R/a/report.json'))['agent'];b=json.load(open('$R/b/report.json'))['agent'];print('resumed == uninterrupted:', a==b)" > $W/sig-check.txt
lscpu > $W/cpu/cpu.txt
for k in 1 2; do
  timeout 200 bash .gpu/run.sh bin fx-train bench --device cpu --model dqn,ppo --steps 20 --json > $W/cpu/fx$k.json 2> $W/cpu/fx$k.log
  timeout 200 python3 .gpu/shared/reference/bench.py --cpu --threads 1 --models dqn,ppo --steps 20 --no-compile --out $W/cpu/torch$k.json > $W/cpu/torch$k.log 2>&1
  python3 scripts/compare.py $W/cpu/fx$k.json $W/cpu/torch$k.json --markdown > $W/cpu/compare$k.md 2>&1
done
timeout 150 bash .gpu/run.sh bin fx-train bench --device cpu --model mamba2 --steps 3 --json > $W/cpu/fx-mamba2.json 2> $W/cpu/fx-mamba2.log
tar czf $O/all.tgz -C $W .
