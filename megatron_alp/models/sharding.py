"""Full tensor <-> tensor-parallel shard, for Megatron-Core parameters.

Megatron marks each tensor-parallel parameter with ``tensor_model_parallel`` and its
``partition_dim``; shards are contiguous chunks along that dimension, with one exception: the
fused gate/up projection of a gated MLP (``linear_fc1`` with ``gated_linear_unit``) holds
``[gate_r; up_r]`` on rank r (and so does its LoRA B factor), so the full tensor ``[gate; up]`` is
split per half. The query-key-value projection needs no special case: Megatron stores it grouped
per query group, so TP shards are whole groups. Used by the converters, resharding and the weight
export to rollout engines.
"""

from __future__ import annotations

import torch


def is_glu_fc1(name: str, gated: bool) -> bool:
    """The fused gate/up projection's weight or bias, or its LoRA B factor (rows laid out like the weight's)."""
    return gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias", "linear_fc1_lora.B"))


def shard(full: torch.Tensor, name: str, partition_dim: int | None, rank: int, size: int, gated: bool) -> torch.Tensor:
    """This rank's shard of a full tensor (``partition_dim`` None: replicated)."""
    if partition_dim is None or size == 1:
        return full
    if full.shape[partition_dim] % size:
        raise ValueError(
            f"{name}: dimension {partition_dim} of shape {tuple(full.shape)} is not divisible by "
            f"tensor parallel size {size}"
        )
    if is_glu_fc1(name, gated):
        gate, up = torch.chunk(full, 2, dim=partition_dim)
        return torch.cat(
            [torch.chunk(gate, size, dim=partition_dim)[rank], torch.chunk(up, size, dim=partition_dim)[rank]],
            dim=partition_dim,
        )
    return torch.chunk(full, size, dim=partition_dim)[rank].contiguous()


def merge(shards: list[torch.Tensor], name: str, partition_dim: int | None, gated: bool) -> torch.Tensor:
    """The full tensor from all ranks' shards (inverse of :func:`shard`)."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if is_glu_fc1(name, gated):
        halves = [torch.chunk(s, 2, dim=partition_dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=partition_dim)
    return torch.cat(shards, dim=partition_dim)


def partition_dim_of(param: torch.Tensor) -> int | None:
    """The TP partition dimension Megatron recorded on a parameter, or None if replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return int(getattr(param, "partition_dim", 0))
    return None


def gather_tp(local: torch.Tensor, name: str, partition_dim: int | None, group, gated: bool) -> torch.Tensor:
    """All-gather a TP-sharded tensor over ``group`` and merge it into the full tensor."""
    size = torch.distributed.get_world_size(group)
    if partition_dim is None or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return merge(parts, name, partition_dim, gated)
