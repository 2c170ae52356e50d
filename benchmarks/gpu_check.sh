#!/usr/bin/env bash
# GPU check, for a machine with CUDA and torch already installed (nothing is installed
# or downloaded): runs the CUDA-only tests, then a short bf16 ZeRO-3 timing on one GPU
# with the measured peak memory printed beside the planner's prediction. The CUDA tests
# include the offload tiers (pinned host buffers, side-stream copies; bit-identical to
# no offload).
# Usage (from the repository root): bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src:.
PY=${PYTHON:-python3}
$PY - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
echo "== CUDA tests"
timeout 300 $PY -m pytest -q -p no:cacheprovider -o addopts="" -k "cuda" tests/ 2>&1 | tail -15
echo "== bf16 ZeRO-3 timing (1 rank, nccl) vs planner"
timeout 240 $PY benchmarks/gpu_zero3.py 2>&1 | tail -30
