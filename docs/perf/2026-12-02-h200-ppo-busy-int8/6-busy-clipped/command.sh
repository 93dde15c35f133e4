#!/usr/bin/env bash
# Device command 6 (after the busy meter's first sample is clipped to the loop's start):
# profiled runs, then two PPO runs whose metrics give the busy fraction per interval.
set -u
O=${OUT:-results}; W=$O/w; mkdir -p $W
OUT=$W RUN_SPECS="ppo20k:ppo:--steps 20000;ppo20k-again:ppo:--steps 20000;ppo20k-third:ppo:--steps 20000;ppo40k:ppo:--steps 40000;dqn10k:dqn:--steps 10000;tft:tft:--epochs 1" bash scripts/gpu-runs.sh runs
R=/tmp/fxr; rm -rf $R; mkdir -p $R
for k in 1 2; do
bash .gpu/run.sh bin fx-train train --model ppo --steps 20000 --device cuda --out $R/p$k > $W/ppo-intervals-run$k.log 2>&1
python3 - "$R/p$k/metrics.jsonl" >> $W/ppo20k-intervals.txt <<'PY'
import json, sys
print(sys.argv[1])
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("gpu_busy_fraction") is not None:
        print(f"elapsed {m['elapsed_s']:.2f} s  env_steps {m['env_steps']}  gpu_busy {m['gpu_busy_fraction']:.3f}")
PY
grep "GPU busy" $W/ppo-intervals-run$k.log >> $W/ppo20k-intervals.txt
done
tar czf $O/all.tgz -C $W .
