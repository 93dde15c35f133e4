#!/usr/bin/env bash
# Unpacks pack.tar.xz (stripped bin/ and tests/) into /tmp/fxgpu, where run.sh looks.
set -e
G=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/fxgpu
xz -dc "$G/pack.tar.xz" | tar -x -C /tmp/fxgpu
chmod +x /tmp/fxgpu/bin/* /tmp/fxgpu/tests/*
# The CLI and quant tests run the binary cargo built beside them (CARGO_BIN_EXE_fx-train).
BR=$(cat "$G/BUILD_ROOT")
mkdir -p /root/.cache/fx-cuda/target/main/release
cp /tmp/fxgpu/bin/fx-train /root/.cache/fx-cuda/target/main/release/fx-train
echo "unpacked: $(ls /tmp/fxgpu/bin | wc -l) binaries, $(ls /tmp/fxgpu/tests | wc -l) test binaries"
