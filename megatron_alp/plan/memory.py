"""Per-GPU memory plan of a run: what each phase holds on its fullest GPU, and whether it fits.

:func:`memory_plan` counts every phase (:mod:`~megatron_alp.plan.peaks`, from the estimates of
:mod:`~megatron_alp.plan.estimates`) and, for a plan that does not fit, the changes that would
(:mod:`~megatron_alp.plan.advice`). A plan fits when each phase stays under 95% of the GPU
(:data:`~megatron_alp.plan.report.HEADROOM`: allocator fragmentation and the error of these
counts). :func:`check_fits` is the trainer's start-up check; docs/results/memory_plan.md has the plan of
every shipped GPU config.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_alp.config import Config, ConfigError
from megatron_alp.plan.advice import advice
from megatron_alp.plan.architecture import resolve_architecture
from megatron_alp.plan.peaks import count_peaks
from megatron_alp.plan.report import MemoryPlan
from megatron_alp.runtime.platform import has_gpu

DEFAULT_GPU_MEM_GIB = 80.0  # H100 80GB


def memory_plan(cfg: Config, gpus: int, gpu_mem_gib: float, hf_config: Optional[dict] = None,
                nproc_per_node: Optional[int] = None) -> MemoryPlan:
    """The per-GPU memory of each phase of ``cfg`` on ``gpus`` GPUs of ``gpu_mem_gib`` GiB (with
    ``rollout.placement: separate``: ``gpus`` trainer GPUs, ``nproc_per_node`` per node, and the
    nodes' ``rollout.gpus``); a plan that does not fit carries advice: single config changes, each
    planned, that would help."""
    if gpus < 1 or gpu_mem_gib <= 0 or (nproc_per_node is not None and nproc_per_node < 1):
        raise ConfigError(f"--gpus and --nproc-per-node must be >= 1 and --gpu-mem > 0 (got {gpus}, "
                          f"{nproc_per_node}, {gpu_mem_gib})")
    try:
        hf, source = resolve_architecture(cfg, hf_config)
        plan = count_peaks(cfg, gpus, gpu_mem_gib, hf, source, nproc_per_node)
    except ConfigError:
        raise
    except ValueError as err:  # an unreadable config.json, or an architecture hf_to_megatron refuses
        raise ConfigError(f"model ({cfg.model.hf_path or cfg.model.tiny}): {err}") from None
    if plan.fits:
        return plan
    return dataclasses.replace(plan, advice=advice(cfg, gpus, gpu_mem_gib, hf, source, plan, nproc_per_node))


def check_fits_here(cfg: Config, world_size: int, nproc_per_node: int) -> Optional[MemoryPlan]:
    """:func:`check_fits` on this machine's GPU (the trainer's start-up check); None on a CPU."""
    if not has_gpu():
        return None
    return check_fits(cfg, world_size, torch.cuda.get_device_properties(0).total_memory / 2**30,
                      nproc_per_node=nproc_per_node)


def check_fits(cfg: Config, gpus: int, gpu_mem_gib: float, hf_config: Optional[dict] = None,
               nproc_per_node: Optional[int] = None) -> MemoryPlan:
    """The trainer's start-up check on GPUs: the plan, or a ConfigError naming the keys to change."""
    plan = memory_plan(cfg, gpus, gpu_mem_gib, hf_config, nproc_per_node)
    if not plan.fits:
        per_node = f" --nproc-per-node {nproc_per_node}" if nproc_per_node else ""
        raise ConfigError(plan.refusal() + f"\n(`megatron-alp plan CONFIG --gpus {gpus}{per_node} --gpu-mem "
                          f"{gpu_mem_gib:g}` prints the per-phase table; docs/memory_plan.md explains it)")
    return plan
