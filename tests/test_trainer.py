"""Issue #6: the RL trainer end to end on the CPU (real vLLM, Megatron, math-verify)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"

# A CI-sized run: fewer, smaller iterations of the quickstart.
SMALL = [
    "trainer.progress_bar=false",
    "trainer.tensorboard=false",
    "trainer.prompts_per_iteration=16",
    "trainer.updates_per_iteration=2",
]


def train(run_dir: Path, *overrides: str, env: dict | None = None, nproc: int = 1, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_port", str(_free_port()), "-m", "megatron_alp.cli", "train", str(QUICKSTART),
           f"trainer.output_dir={run_dir}", *SMALL, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=900)
    return proc.returncode, out


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quickstart_ci_sized_reward_rises(tmp_path):
    run = tmp_path / "quick"
    rc, out = train(run, "trainer.iterations=8", "trainer.save_interval=8")
    assert rc == 0, out[-6000:]
    m = metrics(run)
    assert [r["iteration"] for r in m] == list(range(8))
    rewards = [r["reward/mean"] for r in m]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
    for key in ("ratio/p2", "ratio/p98", "mismatch/kl_k3", "sigma/mean", "grad_norm", "throughput/tokens_per_s"):
        assert key in m[-1], key
    assert (run / "plots").is_dir() and any((run / "plots").glob("*.png"))
    assert (run / "checkpoints").is_dir()


def _same_metrics(a: dict, b: dict) -> None:
    for key in ("reward/mean", "loss/policy", "ratio/p50", "mismatch/kl_k3", "grad_norm", "sigma/mean", "step"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])


@pytest.mark.slow
def test_sigkill_during_save_and_training_resumes_to_the_same_metrics(tmp_path):
    common = ["trainer.iterations=4", "trainer.save_interval=1", "trainer.sft_warmup_steps=30"]
    rc, out = train(tmp_path / "straight", *common)
    assert rc == 0, out[-6000:]
    straight = metrics(tmp_path / "straight")

    # killed while writing the checkpoint of iteration 3: resumes from iteration 2
    run = tmp_path / "killed_in_save"
    rc, out = train(run, *common, env={"MEGATRON_ALP_KILL_DURING_SAVE": "3"})
    assert rc != 0
    assert not (run / "checkpoints" / "iter_0000003").exists()
    rc, out = train(run, *common)
    assert rc == 0 and "resumed from" in out, out[-6000:]
    resumed = metrics(run)
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed):
        _same_metrics(a, b)

    # killed in the middle of training
    run = tmp_path / "killed_in_training"
    proc = train(run, *common, wait=False)
    deadline = time.time() + 600
    while len(metrics(run)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rc, out = train(run, *common)
    assert rc == 0, out[-6000:]
    for a, b in zip(straight, metrics(run)):
        _same_metrics(a, b)


def test_bad_inputs_fail_early_with_clear_errors(tmp_path):
    rc, out = train(tmp_path / "r1", "data.train_files=[data/does_not_exist.jsonl]", "trainer.iterations=1")
    assert rc != 0 and "does_not_exist.jsonl" in out
    rc, out = train(tmp_path / "r2", "loss.nmae=grpo")
    assert rc != 0 and "loss.nmae: unknown key" in out
    rc, out = train(tmp_path / "r3", "trainer.prompts_per_iteration=3", "trainer.updates_per_iteration=5")
    assert rc != 0 and "must split evenly" in out
