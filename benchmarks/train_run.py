"""One ``megatron-alp train`` run for the benchmarks that compare runs side by side (no megatron import
here, so a benchmark's terminal stays its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(config: Path, run_dir: Path, overrides: list[str]) -> float:
    """``megatron-alp train`` into ``run_dir`` (output in its train.log); seconds taken. Exits naming
    the log when the run fails."""
    cmd = [sys.executable, "-m", "megatron_alp.cli", "train", str(config), f"trainer.output_dir={run_dir}", *overrides]
    started = time.time()
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"the {run_dir.name} run failed (exit {rc}): see {run_dir / 'train.log'}")
    return time.time() - started
