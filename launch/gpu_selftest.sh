#!/usr/bin/env bash
# GPU self-test for a new machine or image: 3 RL iterations of a ~0.5B random model per GPU
# configuration (vLLM bf16 and FP8; TP=2 and DP=2 with 2+ GPUs; SGLang when installed), then
# the rest of the GPU test suite (its test of this self-test is deselected: the self-test runs
# once). Prints rollout throughput, sync time and peak memory per phase.
#   bash launch/gpu_selftest.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
  || { echo "error: no CUDA GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)" >&2; exit 2; }
"$PYTHON" benchmarks/gpu_selftest.py "$@"
"$PYTHON" -m pytest -q -m gpu tests --deselect tests/test_gpu_selftest.py::test_gpu_selftest_runs_every_variant
