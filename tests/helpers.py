"""Shared test helpers: launching multi-rank checks with torchrun over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from megatron_alp.runtime.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict | None = None) -> str:
    """Run ``tests/dist/<script>`` on ``nproc`` gloo ranks; fail the test with the output on error."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_port", str(free_port()), str(ROOT / "tests" / "dist" / script), *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} {' '.join(args)} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out


def run_checks(script: str, out: Path) -> dict:
    """Run a test file as a script in a fresh process (one rank, no inherited rendezvous: the CPU
    shims it applies stay out of pytest's process); it records each check's result in ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, script, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def record_checks(checks: dict, path: str) -> None:
    """The script side of :func:`run_checks`: run every check, record each one's result or traceback
    (every check reports; the test of each asserts its own)."""
    results = {}
    for name, fn in checks.items():
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        print(name, "ok" if results[name]["ok"] else "FAILED", flush=True)
    Path(path).write_text(json.dumps(results, default=str))


def passed(results: dict, name: str) -> dict:
    """One check's record from :func:`run_checks`, failing the test with its traceback if it failed."""
    r = results[name]
    assert r["ok"], f"{name} failed:\n{r['error']}"
    return r


def read_results(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (an exited one that nobody reaped yet is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
