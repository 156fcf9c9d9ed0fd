"""The phases of an iteration: their wall time, their peak GPU memory, and the rollout window.

``timing/<phase>_s`` is a phase's wall time and ``memory/<phase>_peak_gib`` the trainer
allocator's peak during it (GPUs only); ``memory/<phase>_used_gib`` is the memory in use on the
whole GPU (the engine's too, which may live in another process). In a colocated GPU run the
engine and Megatron take turns on the GPU: :func:`offloaded` moves Megatron's state to pinned host
memory (``rollout.offload_*``) and empties the allocator cache, and :func:`engine_awake` holds the
engine awake inside that window.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch

from megatron_alp.runtime.platform import has_gpu
from megatron_alp.training.offload import TrainingStateOffloader


@contextlib.contextmanager
def timed(metrics: dict, phase: str) -> Iterator[None]:
    """``metrics["timing/<phase>_s"]``: the wall time of the block."""
    t0 = time.time()
    yield
    metrics[f"timing/{phase}_s"] = time.time() - t0


@contextlib.contextmanager
def peak_memory(metrics: dict, phase: str) -> Iterator[None]:
    """``metrics["memory/<phase>_peak_gib"]``: the trainer allocator's peak during the block (GPUs)."""
    if has_gpu():
        torch.cuda.reset_peak_memory_stats()
    yield
    if has_gpu():
        metrics[f"memory/{phase}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


def memory_in_use(phase: str) -> dict:
    """``memory/<phase>_used_gib``: the memory in use on the whole GPU now ({} on the CPU)."""
    if not has_gpu():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {f"memory/{phase}_used_gib": (total - free) / 2**30}


@contextlib.contextmanager
def offloaded(offloader: Optional[TrainingStateOffloader], stats: dict) -> Iterator[None]:
    """Megatron's state off the GPU for the block (``offload/*`` and ``reload/*`` into ``stats``);
    a no-op without an offloader (CPU runs, separate placement, nothing to offload)."""
    if offloader is not None:
        stats.update(offloader.offload())
    try:
        yield
    finally:
        if offloader is not None:
            stats.update(offloader.reload())


@contextlib.contextmanager
def engine_awake(rollout, offloader: Optional[TrainingStateOffloader], stats: dict) -> Iterator[None]:
    """The rollout window: Megatron's state offloaded while the (colocated) engine is awake."""
    with offloaded(offloader, stats):
        rollout.wake_up()
        try:
            yield
        finally:
            rollout.sleep()
