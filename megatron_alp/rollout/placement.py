"""Where rollout engine replicas run: which ranks start them, on which GPUs or CPU cores.

The job's ``world`` ranks are cut into ``replicas`` consecutive blocks of ``stride = world /
replicas`` ranks; the first rank of block k (its *leader*) starts replica k, colocated with the
trainer ranks of its block. On GPUs the replica takes the block's first
``rollout.tensor_parallel_size`` GPUs (the leader's own GPU first, so a tensor the leader hands
over by CUDA IPC is device 0 for every engine worker); on the CPU, when several replicas share a
machine, each gets its own share of the cores for its threads. Blocks never span nodes on GPUs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

from megatron_alp.config import ConfigError, RolloutConfig


@dataclass(frozen=True)
class ReplicaLayout:
    """The same on every rank: how many replicas, and which rank leads each."""

    replicas: int
    stride: int

    def leader(self, replica: int) -> int:
        return replica * self.stride

    def replica_of(self, rank: int) -> Optional[int]:
        """The replica ``rank`` leads, or None."""
        return rank // self.stride if rank % self.stride == 0 else None


@dataclass(frozen=True)
class Placement:
    """One replica's devices: CUDA device ids (as the job's CUDA_VISIBLE_DEVICES names them) or CPU
    cores for its threads (None: leave thread placement to the engine's defaults)."""

    replica: int
    replicas: int
    gpus: Optional[tuple[int, ...]] = None
    cores: Optional[tuple[int, ...]] = None


def replica_layout(cfg: RolloutConfig, world: int, data_parallel: int, gpu: bool) -> ReplicaLayout:
    """Resolve ``rollout.replicas`` for a job of ``world`` ranks (ConfigError when it cannot be placed)."""
    tp = cfg.tensor_parallel_size
    if cfg.replicas == "auto":
        replicas = max(1, world // tp) if gpu else max(1, data_parallel)
    else:
        replicas = cfg.replicas
    if world % replicas:
        raise ConfigError(f"rollout.replicas={replicas} must divide the job's {world} ranks (each replica is "
                          f"started by one rank and colocated with the ranks after it)")
    stride = world // replicas
    if gpu and stride < tp:
        raise ConfigError(f"rollout.replicas={replicas} on {world} GPUs leaves {stride} GPU(s) per replica, "
                          f"fewer than rollout.tensor_parallel_size={tp}")
    return ReplicaLayout(replicas=replicas, stride=stride)


def visible_gpus() -> list[int]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [int(x) for x in listed.split(",") if x.strip()]
    import torch

    return list(range(torch.cuda.device_count()))


def engine_placement(cfg: RolloutConfig, layout: ReplicaLayout, rank: int, local_rank: int, local_world: int,
                     gpu: bool) -> Optional[Placement]:
    """This rank's replica and its devices, or None when the rank leads no replica."""
    replica = layout.replica_of(rank)
    if replica is None:
        return None
    if gpu:
        gpus = visible_gpus()
        tp = cfg.tensor_parallel_size
        if local_rank + tp > len(gpus):
            raise ConfigError(f"rollout replica {replica} (rank {rank}, local GPU {local_rank}) needs "
                              f"rollout.tensor_parallel_size={tp} GPUs of its node, which has {len(gpus)}")
        return Placement(replica, layout.replicas, gpus=tuple(gpus[local_rank:local_rank + tp]))
    local_replicas = max(1, local_world // layout.stride)
    if local_replicas == 1:
        return Placement(replica, layout.replicas)
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_replicas
    if share == 0:
        return Placement(replica, layout.replicas)
    j = (local_rank // layout.stride) % local_replicas
    return Placement(replica, layout.replicas, cores=tuple(cores[j * share:(j + 1) * share]))


def placement_vars(placement: Optional[Placement]) -> dict[str, str]:
    """Environment an engine's processes are started under: its GPUs (CUDA_VISIBLE_DEVICES, read by
    the engine's worker processes) or its CPU cores (vLLM's VLLM_CPU_OMP_THREADS_BIND)."""
    wanted: dict[str, str] = {}
    if placement is not None and placement.gpus is not None:
        wanted["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in placement.gpus)
    if placement is not None and placement.cores is not None:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in placement.cores)
    return wanted


@contextlib.contextmanager
def placement_env(placement: Optional[Placement]) -> Iterator[None]:
    """:func:`placement_vars` set in this process while an engine starts its processes, then
    restored: this process keeps its own devices."""
    wanted = placement_vars(placement)
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
