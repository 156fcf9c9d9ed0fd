"""The vLLM general plugin (megatron_alp/rollout/vllm/plugin.py)."""

import subprocess
import sys

from megatron_alp.rollout.vllm.plugin import RECHECK_MS, SLEEP_WHEN_IDLE

PROBE = """
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast
assert "megatron_alp" in [e.name for e in entry_points(group="vllm.general_plugins")], "plugin not installed"
load_general_plugins()
print(shm_broadcast.SpinCondition.__init__.__defaults__[0], shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
"""


def busy_loop_and_recheck(env: dict) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    spin, recheck = out.stdout.strip().splitlines()[-1].split()
    return float(spin), float(recheck)


def test_vllm_processes_of_our_engine_sleep_when_idle_and_others_are_untouched():
    """vLLM loads the plugin in each process it starts; only processes started by our engine (the
    variable it sets) stop spinning while they wait, and look at the buffer again every few
    milliseconds: a notification lost by vLLM's PUB socket would otherwise stall a reader for 5 s
    on every step of a generation (tests/dist/check_weight_sync.py's TP=2 sync hung so)."""
    import os

    base = {k: v for k, v in os.environ.items() if k != SLEEP_WHEN_IDLE}
    assert busy_loop_and_recheck(base) == (1, 5000)
    assert busy_loop_and_recheck({**base, SLEEP_WHEN_IDLE: "1"}) == (0, RECHECK_MS) and RECHECK_MS <= 10
