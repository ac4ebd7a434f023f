#!/usr/bin/env bash
# Runs on a machine with an NVIDIA GPU (the `cuda` tests, then the GPU benchmark).
# Usage: bash scripts/device_check.sh [OUT_DIR]
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -m cuda tests/ops tests/engine tests/models -p no:cacheprovider 2>&1 \
  | tee "$out/cuda_tests.log" | tail -5
python3 benchmarks/gpu_bench.py --out "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.log" \
  | grep -v Warning
