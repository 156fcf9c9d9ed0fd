"""The vLLM general plugin (megatron_alp/rollout/vllm_plugin.py)."""

import subprocess
import sys

from megatron_alp.rollout.vllm_plugin import SLEEP_WHEN_IDLE

PROBE = """
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
assert "megatron_alp" in [e.name for e in entry_points(group="vllm.general_plugins")], "plugin not installed"
load_general_plugins()
print(SpinCondition.__init__.__defaults__[0])
"""


def busy_loop_seconds(env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_vllm_processes_of_our_engine_sleep_when_idle_and_others_are_untouched():
    """vLLM loads the plugin in each process it starts; only processes started by our engine (the
    variable it sets) stop spinning while they wait."""
    import os

    base = {k: v for k, v in os.environ.items() if k != SLEEP_WHEN_IDLE}
    assert busy_loop_seconds(base) == 1
    assert busy_loop_seconds({**base, SLEEP_WHEN_IDLE: "1"}) == 0
