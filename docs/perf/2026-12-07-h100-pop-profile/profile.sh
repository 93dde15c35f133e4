#!/usr/bin/env bash
# One device call: where a population step's time goes. The bench's own step times first
# (no profiler), then ncu's per-kernel durations over the BF16 population cases (--quick):
# every launch with its grid, so steps are split by the optimiser kernel on the host.
set -u
OUT=${OUT:-results}; L=$OUT/logs; mkdir -p "$L"
G=.gpu
mkdir -p /tmp/fxgpu && xz -dc $G/fx-train.xz > /tmp/fxgpu/fx-train && chmod +x /tmp/fxgpu/fx-train
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm --format=csv > "$L/env.txt" 2>&1; cat "$L/env.txt"
export FX_REQUIRE_GPU=1 LD_LIBRARY_PATH=/usr/local/cuda/lib64
X=/tmp/fxgpu/fx-train
T0=$(date +%s)
timeout 120 $X bench --model pop --precision bf16 --json > "$L/bench-bf16.json" 2> "$L/bench-bf16.err"; echo "bench rc=$? at $(( $(date +%s)-T0 )) s"
python3 - "$L/bench-bf16.json" <<'PY'
import json,sys
try:
    d=json.load(open(sys.argv[1]))
    for r in d["results"]:
        print(r.get("case"), r.get("mode"), r.get("step_ms_median"), r.get("samples_per_s"))
except Exception as e: print("no json", e)
PY
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout ${NCU_TIMEOUT:-330} $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum \
  --csv --page raw --print-units base --log-file "$L/ncu-raw.csv" \
  $X bench --model pop --precision bf16 --quick > "$L/ncu-bench.log" 2>&1
echo "ncu rc=$? at $(( $(date +%s)-T0 )) s, $(wc -l < "$L/ncu-raw.csv") lines"
xz -9 -k "$L/ncu-raw.csv" 2>/dev/null && rm -f "$L/ncu-raw.csv"
tail -5 "$L/ncu-bench.log"
ls -la "$L"
