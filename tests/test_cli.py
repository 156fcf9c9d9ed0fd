"""The `megatron-alp` command line: bad input is one clear message on stderr and exit status 2,
never a traceback; `--debug` shows the traceback.

The bad-input cases run `megatron_alp.cli.main` in this process (each is an argument or config error
caught before any work starts); one of them, and `make-tiny`, run as real processes, for what a
terminal shows: nothing from the libraries (import-time warnings included) before or after our line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_alp.cli import main
from megatron_alp.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
ALP = "configs/qwen2.5-math-1.5b_token_alp.yaml"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MEGATRON_ALP_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "megatron_alp.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def in_repo(monkeypatch):
    """main() as the command runs it from the repository root, without MEGATRON_ALP_DEBUG."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("MEGATRON_ALP_DEBUG", raising=False)


BAD_INPUT = [
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
]


def _one_message(args, names, rc: int, stdout: str, stderr: str) -> None:
    assert rc == 2, (rc, stdout[-2000:], stderr[-3000:])
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert stderr.startswith(f"megatron-alp {args[0]}: error: "), stderr[-3000:]
    for name in names:
        assert name in stderr, (name, stderr)


@pytest.mark.parametrize("args, names", BAD_INPUT)
def test_bad_input_is_one_message_and_exit_2(args, names, in_repo, capsys):
    rc = main(list(args))
    out = capsys.readouterr()
    _one_message(args, names, rc, out.out, out.err)


def test_a_real_process_shows_bad_input_as_one_message_and_exit_2():
    """The terminal of `megatron-alp train` with a bad key: our one message first on stderr (no
    library warning before it), status 2, no traceback."""
    args, names = BAD_INPUT[0]
    proc = cli(*args)
    _one_message(args, names, proc.returncode, proc.stdout, proc.stderr)


def test_debug_shows_the_traceback(in_repo):
    """--debug lets the error out of main (the interpreter prints its traceback)."""
    with pytest.raises(ConfigError, match="loss.name"):
        main(["--debug", "train", "configs/quickstart_cpu.yaml", "loss.name=ppo"])


def test_make_tiny_is_quiet_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "tiny"
    proc = cli("make-tiny", "qwen3", str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    log = tmp_path / "tiny.log"
    assert proc.stdout.splitlines() == [f"wrote a tiny qwen3 model and its tokenizer to {out} (library output in {log})"]
    assert (out / "config.json").is_file() and "Writing model shards" in log.read_text()
