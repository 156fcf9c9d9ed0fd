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
spinning. With the variable set, readers wait on vLLM's notification socket at once, and look at
the buffer again every :data:`RECHECK_MS` in case a notification was lost.

Every process of our engine (:data:`ENGINE_RANK`: the pid of the rank that started it) ends with
its parent (:func:`~megatron_alp.runtime.process.end_with_parent`): a rank killed by SIGKILL
would otherwise leave its engine core running, an orphan holding its shared memory, and on a
cluster its GPU memory, until the machine reboots. Each also gets a janitor
(:func:`~megatron_alp.runtime.process.clean_shared_memory_after`) for the /dev/shm segments it
maps: vLLM unlinks them only on a clean exit of their creator, and its workers are terminated.
"""

from __future__ import annotations

import os

from megatron_alp.runtime.process import clean_shared_memory_after, end_with_parent

SLEEP_WHEN_IDLE = "MEGATRON_ALP_VLLM_SLEEP_WHEN_IDLE"
# How long a reader that waits on the notification socket waits before it looks at the buffer
# again (vLLM: 5 s). A notification can be lost: the writer's PUB socket keeps one pending message
# and drops the next, so a reader that wakes for one write may never hear of the write after it.
# vLLM's 1 s spin after every read hides that; without the spin the reader would sit out the full
# recheck interval for such a write, on every step of a generation.
RECHECK_MS = 2
# Set by the engine to the pid of the rank that starts it; its processes inherit it.
ENGINE_RANK = "MEGATRON_ALP_ENGINE_RANK_PID"


def register() -> None:
    rank = os.environ.get(ENGINE_RANK)
    if rank is not None and int(rank) != os.getpid():
        end_with_parent(int(rank))
        clean_shared_memory_after(os.getpid())
    if os.environ.get(SLEEP_WHEN_IDLE) == "1":
        sleep_when_idle()


def sleep_when_idle() -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is not None and spin.__init__.__defaults__ == (1,):
        spin.__init__.__defaults__ = (0,)
    if getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None) == 5000:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
