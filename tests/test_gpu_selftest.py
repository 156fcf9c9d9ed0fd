"""The GPU self-test (benchmarks/gpu_selftest.py, launch/gpu_selftest.sh): every GPU configuration the
machine allows trains 3 RL iterations of a ~0.5B model. GPU machines only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (the self-test trains on one)")
def test_gpu_selftest_runs_every_variant(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_selftest.py"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "| vllm bf16 |" in proc.stdout and "FAILED" not in proc.stdout


def test_gpu_selftest_refuses_a_machine_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_selftest.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2 and "no CUDA GPU visible" in proc.stderr
