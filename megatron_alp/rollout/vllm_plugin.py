"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml).

vLLM calls :func:`register` at the start of every one of its processes, including the engine
core and the workers it spawns, which a setting made in the trainer's process does not reach
(vLLM's CPU platform starts them with ``spawn``). It acts only in processes started by this
project's engine, which sets :data:`SLEEP_WHEN_IDLE` in their environment: any other vLLM in the
same environment keeps its behaviour.

On the CPU, vLLM's processes wait for each other's messages by spinning (``sched_yield``) for 1 s
after every message (``SpinCondition`` in ``shm_broadcast``), so the waiting engine core keeps a
core busy for as long as its worker computes. On a GPU that costs an otherwise idle host core; on
the CPU the cores are the compute, and two replicas on two cores would spend half of them
spinning. With the variable set, readers wait on vLLM's notification socket at once.
"""

from __future__ import annotations

import os

SLEEP_WHEN_IDLE = "MEGATRON_ALP_VLLM_SLEEP_WHEN_IDLE"


def register() -> None:
    if os.environ.get(SLEEP_WHEN_IDLE) != "1":
        return
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is not None and spin.__init__.__defaults__ == (1,):
        spin.__init__.__defaults__ = (0,)
