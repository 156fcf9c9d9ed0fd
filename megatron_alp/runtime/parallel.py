"""Process groups: torch.distributed + Megatron-Core model-parallel state, GPU or CPU (gloo)."""

from __future__ import annotations

import atexit
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_alp.runtime.comm import install_checker
from megatron_alp.runtime.platform import apply_cpu_shims, dist_backend, has_gpu, tracking_collectives


def init_distributed(parallel, seed: int = 1, timeout_min: int = 30) -> None:
    """Initialise torch.distributed (from torchrun's env, or a single process) and Megatron's
    model-parallel groups of ``parallel`` (a :class:`~megatron_alp.config.ParallelConfig`), then
    seed Megatron's RNG tracker. Idempotent."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if apply_cpu_shims() and tracking_collectives():
        install_checker()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if has_gpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(dist_backend(), timeout=timedelta(minutes=timeout_min))
        # A process that exits with a live gloo group can abort in the group's destructor during
        # interpreter shutdown ("terminate called without an active exception", SIGABRT after a
        # successful run): tear the groups down while Python is still whole.
        atexit.register(_destroy_at_exit)
    world = dist.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ValueError(
            f"parallel: world size {world} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size = {tp * pp}"
        )
    if ps.model_parallel_is_initialized() and not _groups_alive(ps):
        # Megatron's groups of a world destroyed since (a finished run or command in this process):
        # its module globals still hold them, so make them anew in this world.
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            create_gloo_process_groups=True,
        )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _groups_alive(ps) -> bool:
    """Whether Megatron's model-parallel groups belong to torch.distributed's current world."""
    group = ps.get_tensor_model_parallel_group(check_initialized=False)
    return group is not None and group in dist.distributed_c10d._world.pg_map


def destroy_distributed() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    """:func:`destroy_distributed` at interpreter exit, after the groups of an in-process vLLM
    engine still alive in this process: its exit finalizer (registered earlier, so run later)
    would otherwise try to destroy groups already gone and print a traceback."""
    import sys

    vllm_state = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_state is not None and getattr(vllm_state, "_WORLD", None) is not None:
        try:
            vllm_state.destroy_model_parallel()
            vllm_state.destroy_distributed_environment()
        except Exception:  # groups already torn down elsewhere: nothing left to release
            pass
    destroy_distributed()


def free_port() -> int:
    """A TCP port free on the loopback now (for a rendezvous this process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
