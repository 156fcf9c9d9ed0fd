"""Where rollout engine replicas run: which ranks start them, on which GPUs or CPU cores.

The job's ``world`` ranks are cut into ``replicas`` consecutive blocks of ``stride = world /
replicas`` ranks; the first rank of block k (its *leader*) starts replica k and talks to it.

- ``rollout.placement: colocated``: the replica runs on its block's own devices. On GPUs it takes
  the block's first ``rollout.tensor_parallel_size`` GPUs (the leader's own GPU first, so a tensor
  the leader hands over by CUDA IPC is device 0 for every engine worker); on the CPU, when several
  replicas share a machine (or ``rollout.cpu_cores`` is set), each gets its own share of the cores.
- ``rollout.placement: separate``: the replicas run on devices no trainer rank uses: on GPUs the
  node's ``rollout.gpus`` (the trainer ranks take the node's first GPUs), ``tensor_parallel_size``
  each, led by the trainer ranks of the same node; on the CPU ``rollout.cpu_cores`` (default: the
  second half of the job's cores), and the trainer ranks are pinned to the other cores
  (:func:`trainer_cores`), so generation and training run side by side.

Blocks never span nodes on GPUs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_alp.config import ConfigError, RolloutConfig
from megatron_alp.runtime.platform import has_gpu


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


def replica_layout(cfg: RolloutConfig, world: int, data_parallel: int, gpu: bool,
                   local_world: Optional[int] = None) -> ReplicaLayout:
    """Resolve ``rollout.replicas`` for a job of ``world`` ranks, ``local_world`` per node (default:
    all on one node); ConfigError when it cannot be placed."""
    check_sync_placement(cfg, gpu)
    tp = cfg.tensor_parallel_size
    local_world = local_world or world
    if cfg.placement == "separate" and gpu:
        return _separate_gpu_layout(cfg, world, local_world)
    replicas = auto_replicas(cfg, world, data_parallel, gpu, local_world) if cfg.replicas == "auto" else cfg.replicas
    if world % replicas:
        raise ConfigError(f"rollout.replicas={replicas} must divide the job's {world} ranks (each replica is "
                          f"started by one rank and colocated with the ranks after it)")
    stride = world // replicas
    if gpu and stride < tp:
        raise ConfigError(f"rollout.replicas={replicas} on {world} GPUs leaves {stride} GPU(s) per replica, "
                          f"fewer than rollout.tensor_parallel_size={tp}")
    return ReplicaLayout(replicas=replicas, stride=stride)


def check_sync_placement(cfg: RolloutConfig, gpu: bool) -> None:
    """Refuse a ``rollout.sync_method`` that cannot work where the engines are placed on GPUs
    (``gpu``: this is a GPU job; engines on GPUs of their own, ``rollout.gpus``, say so in the config
    alone). On the CPU both combinations work (gloo broadcasts, shared memory)."""
    if cfg.sync_method == "broadcast" and cfg.placement == "colocated" and gpu:
        raise ConfigError("rollout.sync_method: broadcast with rollout.placement: colocated puts the trainer's rank "
                          "and the engine's first worker on one GPU, two ranks of one NCCL group, which NCCL refuses; "
                          "use rollout.sync_method memory (CUDA IPC) or folder, or rollout.placement separate")
    if cfg.sync_method == "memory" and cfg.placement == "separate" and (gpu or cfg.gpus):
        raise ConfigError("rollout.sync_method: memory with rollout.placement: separate hands the engines CUDA IPC "
                          "handles of the trainer's GPU, which engines on GPUs of their own (rollout.gpus) cannot "
                          "see; use rollout.sync_method broadcast (NCCL) or folder, or rollout.placement colocated")


def auto_replicas(cfg: RolloutConfig, world: int, data_parallel: int, gpu: bool, local_world: int) -> int:
    """``rollout.replicas: auto`` for colocated engines and CPU jobs: every ``tensor_parallel_size``
    GPUs generate (one replica per data-parallel rank on the CPU; with separate placement on the
    CPU, one per machine on its engine cores)."""
    if cfg.placement == "separate":
        return max(1, world // local_world)
    return max(1, world // cfg.tensor_parallel_size) if gpu else max(1, data_parallel)


def _separate_gpu_layout(cfg: RolloutConfig, world: int, local_world: int) -> ReplicaLayout:
    """``len(rollout.gpus) / tensor_parallel_size`` replicas per node, each led by one of the node's
    trainer ranks (every ``stride``-th)."""
    if not cfg.gpus:
        raise ConfigError("rollout.placement: separate on GPUs needs rollout.gpus, the GPUs of each node the "
                          "engines use (e.g. [4, 5, 6, 7] with 4 trainer ranks per 8-GPU node)")
    per_node = len(cfg.gpus) // cfg.tensor_parallel_size
    if local_world % per_node:
        raise ConfigError(f"rollout.gpus holds {per_node} replica(s) of rollout.tensor_parallel_size="
                          f"{cfg.tensor_parallel_size} per node, which must divide the node's {local_world} trainer "
                          "ranks (each replica is led by one of them)")
    replicas = per_node * (world // local_world)
    if cfg.replicas != "auto" and cfg.replicas != replicas:
        raise ConfigError(f"rollout.replicas={cfg.replicas}, but rollout.gpus and rollout.tensor_parallel_size "
                          f"place {replicas} replicas on this job's nodes (use auto)")
    return ReplicaLayout(replicas=replicas, stride=world // replicas)


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
    local_replicas = max(1, local_world // layout.stride)
    j = (local_rank // layout.stride) % local_replicas  # this replica's index on its node
    tp = cfg.tensor_parallel_size
    if gpu:
        gpus = visible_gpus()
        if cfg.placement == "separate":
            wanted = cfg.gpus[j * tp:(j + 1) * tp]
            clash = [g for g in wanted if g < local_world or g >= len(gpus)]
            if clash:
                raise ConfigError(f"rollout.gpus {cfg.gpus}: GPU(s) {clash} of rollout replica {replica} are not free "
                                  f"for the engine: the node's {local_world} trainer ranks use GPUs 0-{local_world - 1} "
                                  f"and it has {len(gpus)} GPUs")
            return Placement(replica, layout.replicas, gpus=tuple(gpus[g] for g in wanted))
        if local_rank + tp > len(gpus):
            raise ConfigError(f"rollout replica {replica} (rank {rank}, local GPU {local_rank}) needs "
                              f"rollout.tensor_parallel_size={tp} GPUs of its node, which has {len(gpus)}")
        return Placement(replica, layout.replicas, gpus=tuple(gpus[local_rank:local_rank + tp]))
    engine_cores = engine_core_pool(cfg)
    if engine_cores is None and local_replicas == 1:
        return Placement(replica, layout.replicas)
    cores = engine_cores or sorted(os.sched_getaffinity(0))
    share = len(cores) // local_replicas
    if share == 0:
        if engine_cores is not None:
            raise ConfigError(f"rollout.cpu_cores {list(engine_cores)} has fewer cores than the {local_replicas} "
                              "engine replicas of this machine")
        return Placement(replica, layout.replicas)
    return Placement(replica, layout.replicas, cores=tuple(cores[j * share:(j + 1) * share]))


def engine_core_pool(cfg: RolloutConfig) -> Optional[list[int]]:
    """The CPU cores of a machine's engine replicas: ``rollout.cpu_cores``, with ``placement:
    separate`` by default the second half (at least one) of this process's cores; None: unpinned."""
    if cfg.cpu_cores:
        return list(cfg.cpu_cores)
    if cfg.placement != "separate":
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[len(cores) // 2:] if len(cores) > 1 else cores


def trainer_cores(cfg: RolloutConfig) -> Optional[list[int]]:
    """With ``placement: separate`` on the CPU, the cores the trainer ranks keep (this process's
    cores minus the engines'); None when the trainer shares every core with the engines."""
    if cfg.placement != "separate":
        return None
    engines = set(engine_core_pool(cfg) or ())
    mine = [c for c in sorted(os.sched_getaffinity(0)) if c not in engines]
    return mine or None


def pin_trainer_cores(cfg: RolloutConfig) -> None:
    """On the CPU with separate placement, keep this trainer rank (and its torch threads) off the
    engines' cores (:func:`trainer_cores`); elsewhere nothing changes."""
    keep = None if has_gpu() else trainer_cores(cfg)
    if keep:
        os.sched_setaffinity(0, keep)
        torch.set_num_threads(min(torch.get_num_threads(), len(keep)))


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
    restored: this process keeps its own devices. On CPU cores this process's affinity is the
    replica's meanwhile too, so the engine's processes inherit it (its Python threads included, not
    only the compute threads that vLLM pins)."""
    wanted = placement_vars(placement)
    saved = {k: os.environ.get(k) for k in wanted}
    affinity = os.sched_getaffinity(0)
    os.environ.update(wanted)
    if placement is not None and placement.cores is not None:
        os.sched_setaffinity(0, placement.cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
