#!/usr/bin/env bash
# On the H200 (device tool), from the repo root: bash scripts/mamba2-step-probe/run.sh
# Times the decode-step kernel on 16 and 8 blocks, staged and not, then prints the per-phase
# cycle trace of the default layout (16 blocks, staged). Needs nvcc (the device image has it).
set -euo pipefail
cd "$(dirname "$0")"
nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/m2probe probe.cu
nvcc -O3 -arch=sm_90 -std=c++17 -DFX_S_TRACE -o /tmp/m2probe-trace probe.cu
/tmp/m2probe 1 16
/tmp/m2probe 0 16
/tmp/m2probe 0 8
/tmp/m2probe-trace 1 16
