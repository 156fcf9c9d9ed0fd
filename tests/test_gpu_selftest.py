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


def test_the_script_runs_the_self_test_once(tmp_path):
    """launch/gpu_selftest.sh runs benchmarks/gpu_selftest.py itself (an hour on a GPU machine), then
    the GPU suite without the test that would run it a second time."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"  # passes the GPU check and records every call instead of running it
    fake.write_text(f"#!/usr/bin/env bash\nprintf '%s\\x1f' \"$@\" >> {calls}\necho >> {calls}\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_selftest.sh"), "--out", "somewhere"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)})
    assert proc.returncode == 0, proc.stderr
    argvs = [line.split("\x1f")[:-1] for line in calls.read_text().splitlines()]
    assert [a for a in argvs if "benchmarks/gpu_selftest.py" in a] == [["benchmarks/gpu_selftest.py", "--out", "somewhere"]]
    suite = [a for a in argvs if a[:2] == ["-m", "pytest"]]
    assert len(suite) == 1

    def collected(args):
        """The suite's selection, applied to this file only (collecting every test file takes a minute)."""
        args = [str(ROOT / "tests" / "test_gpu_selftest.py") if a == "tests" else a for a in args]
        out = subprocess.run([sys.executable, *args, "--collect-only", "-p", "no:cacheprovider"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120).stdout
        return "test_gpu_selftest_runs_every_variant" in out

    without_deselect = [a for i, a in enumerate(suite[0]) if "--deselect" not in suite[0][max(i - 1, 0):i + 1]]
    assert collected(without_deselect) and not collected(suite[0])
