"""The vLLM general plugin (megatron_alp/rollout/vllm/plugin.py)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import running

from megatron_alp.rollout.vllm.plugin import RECHECK_MS, SLEEP_WHEN_IDLE
from megatron_alp.runtime.shm_janitor import mapped as mapped_shm

PROBE = """
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast
assert "megatron_alp" in [e.name for e in entry_points(group="vllm.general_plugins")], "plugin not installed"
load_general_plugins()
print(shm_broadcast.SpinCondition.__init__.__defaults__[0], shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
"""


def busy_loop_and_recheck(*envs: dict) -> list[tuple[float, float]]:
    """The plugin's settings as a fresh process with each environment sees them (the processes side by side)."""
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for env in envs]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        spin, recheck = out.strip().splitlines()[-1].split()
        found.append((float(spin), float(recheck)))
    return found


def test_vllm_processes_of_our_engine_sleep_when_idle_and_others_are_untouched():
    """vLLM loads the plugin in each process it starts; only processes started by our engine (the
    variable it sets) stop spinning while they wait, and look at the buffer again every few
    milliseconds: a notification lost by vLLM's PUB socket would otherwise stall a reader for 5 s
    on every step of a generation (tests/dist/check_weight_sync.py's TP=2 sync hung so)."""
    import os

    base = {k: v for k, v in os.environ.items() if k != SLEEP_WHEN_IDLE}
    others, ours = busy_loop_and_recheck(base, {**base, SLEEP_WHEN_IDLE: "1"})
    assert others == (1, 5000)
    assert ours == (0, RECHECK_MS) and RECHECK_MS <= 10


ENGINE_CHILD = """
import sys, time
from megatron_alp.config import RolloutConfig, SamplingConfig
from megatron_alp.models.tiny import make_tiny_model
from megatron_alp.rollout import build_engine
model = make_tiny_model("qwen2", sys.argv[1], seed=3)
cfg = RolloutConfig(dtype="float32", max_model_len=128, engine_process="subprocess",
                    sampling=SamplingConfig(max_prompt_length=64, max_response_length=64))
engine = build_engine(cfg, str(model), seed=0)
print("engine pids", *engine.engine_pids(), flush=True)
time.sleep(600)
"""



def janitor_targets() -> set[str]:
    """The pids that a shared-memory janitor (megatron_alp/runtime/shm_janitor.py) watches."""
    targets = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode().split("\0")
        except OSError:
            continue
        if len(args) > 3 and args[2].endswith("shm_janitor.py"):
            targets.add(args[3])
    return targets


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            todo += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.slow  # a kill/crash soak (minutes on 2 cores): pytest -m slow
def test_engine_processes_end_when_the_rank_that_started_them_is_killed(tmp_path):
    """A rank (here a child process) starts our vLLM engine in its engine-core subprocess and is
    killed by SIGKILL, which it cannot handle: the engine core (whose parent the rank was) and its
    workers end within seconds instead of running on as orphans, and the /dev/shm segments they
    mapped are removed."""
    log = tmp_path / "rank.log"
    with log.open("w") as out:  # a file, not a pipe: nothing dies of a reader that went away
        rank = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD, str(tmp_path / "model")], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "engine pids" not in log.read_text() and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        line = [x for x in log.read_text().splitlines() if x.startswith("engine pids")]
        assert line, log.read_text()[-4000:]
        engine = [int(p) for p in line[0].split()[2:]]
        assert engine and all(running(p) for p in engine)
        processes = [p for e in engine for p in descendants(e)]
        assert set(processes) <= set(descendants(rank.pid))
        segments = {Path("/dev/shm") / name for p in processes for name in mapped_shm(p)}
        assert segments, "vLLM's processes share memory through /dev/shm"
        # each has a janitor for the case where everything is SIGKILLed at once (tests/test_process.py)
        holders = {str(p) for p in processes if mapped_shm(p)}
        assert holders and holders <= janitor_targets(), (holders, janitor_targets())
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 15
    while any(running(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if running(p)], "the engine's processes outlived their rank"
    while any(s.exists() for s in segments) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    assert not [s for s in segments if s.exists()], "the engine's shared memory outlived its processes"
