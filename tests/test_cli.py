"""The `megatron-alp` command line: bad input is one clear message on stderr and exit status 2,
never a traceback; `--debug` shows the traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALP = "configs/qwen2.5-math-1.5b_token_alp.yaml"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MEGATRON_ALP_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "megatron_alp.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, names", [
    (("train", "configs/quickstart_cpu.yaml", "loss.name=ppo"), ["loss.name", "'ppo'", "alp_token"]),
    (("train", "configs/quickstart_cpu.yaml", "loss.nmae=grpo"), ["loss.nmae", "unknown key"]),
    (("train", ALP, "loss.name=grpo"), ["perturbation.enabled", "loss.name=grpo", "allow_with_baseline"]),
    (("train", ALP, "rollout.placement=separate", "rollout.gpus=[4,5,6,7]", "rollout.sync_method=memory"),
     ["rollout.sync_method: memory", "rollout.placement: separate"]),
    (("train", "configs/no_such.yaml"), ["configs/no_such.yaml", "does not exist"]),
    (("train", "configs/quickstart_cpu.yaml", "trainer.iterations"), ["KEY=VALUE"]),
    (("eval", "configs/quickstart_cpu.yaml", "--model", "/nonexistent/model"), ["/nonexistent/model"]),
    (("plot", "/nonexistent/run"), ["/nonexistent/run"]),
    # overrides may come after the options: the bad key is what is reported, not the argument order
    (("eval", "configs/quickstart_cpu.yaml", "--k", "2", "eval.nope=1"), ["eval.nope", "unknown key"]),
    (("mismatch", "configs/quickstart_cpu.yaml", "--prompts", "2", "rollout.nope=1"), ["rollout.nope", "unknown key"]),
])
def test_bad_input_is_one_message_and_exit_2(args, names):
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"megatron-alp {args[0]}: error: "), proc.stderr[-3000:]
    for name in names:
        assert name in proc.stderr, (name, proc.stderr)


def test_debug_shows_the_traceback():
    proc = cli("--debug", "train", "configs/quickstart_cpu.yaml", "loss.name=ppo")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_make_tiny_is_quiet_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "tiny"
    proc = cli("make-tiny", "qwen3", str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    log = tmp_path / "tiny.log"
    assert proc.stdout.splitlines() == [f"wrote a tiny qwen3 model and its tokenizer to {out} (library output in {log})"]
    assert (out / "config.json").is_file() and "Writing model shards" in log.read_text()
